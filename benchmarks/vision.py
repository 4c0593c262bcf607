"""Image prompts: where the time of one image goes, from its bytes to the first token.

    python benchmarks/vision.py                                # tiny Qwen2-VL, CPU
    python benchmarks/vision.py --shape qwen2-vl-2b --sizes 224 448   # random weights of a real shape
    python benchmarks/vision.py --shape qwen2.5-vl-7b --device cuda   # on a CUDA machine

For each square image size, one prompt with one image (a fresh picture every repeat, so nothing
comes from the prefix cache), through the engine with ``max_tokens=1``:

* ``decode``: the data URL decoded and checked (:class:`server.vision.images.ImageLoader`);
* ``process``: the image processor plus the prompt expansion (:func:`expand_prompt`);
* ``encode``: the vision tower (:class:`StepVision` times it inside the prefill step);
* ``prefill``: the rest of the first step (the language model over the whole prompt);
* ``text prefill``: a text-only prompt of the same length, for comparison;
* ``cached``: the same picture sent again (prefix cache through the image: no tower, no prefill of it).

Median of ``--repeat`` runs, milliseconds. Weights are random (no download); the default
tokenizer stands in for the family's (ids stay below its vocabulary).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

try:
    from benchmarks.smoke import parse_with_smoke
except ImportError:  # pragma: no cover - run as ``python benchmarks/vision.py``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.smoke import parse_with_smoke

from sampler import SamplingParams
from server.engine.engine import Engine
from server.engine.sequence import GenerationRequest
from server.engine.vision.expand import Picture, expand_prompt
from server.engine.vision.runner import VisionRunner, load_vision_model
from server.vision.images import ImageLoader, MediaLimits

QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

# Real Qwen-VL shapes (config.json of the released checkpoints), random weights.
SHAPES = {
    "tiny": dict(model_type="qwen2_vl",
                 text=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2),
                 vision=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2)),
    "qwen2-vl-2b": dict(model_type="qwen2_vl",
                        text=dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                  num_attention_heads=12, num_key_value_heads=2, vocab_size=151936),
                        vision=dict(depth=32, embed_dim=1280, hidden_size=1536, num_heads=16, mlp_ratio=4)),
    "qwen2.5-vl-7b": dict(model_type="qwen2_5_vl",
                          text=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                    num_attention_heads=28, num_key_value_heads=4, vocab_size=152064),
                          vision=dict(depth=32, hidden_size=1280, out_hidden_size=3584, intermediate_size=3420,
                                      num_heads=16, window_size=112, fullatt_block_indexes=[7, 15, 23, 31])),
}


def write_model(shape: str, tokenizer, directory: Path, dtype: torch.dtype) -> Path:
    """A random-weight checkpoint of ``shape`` with the default tokenizer plus Qwen's vision tokens."""
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig, Qwen2VLConfig
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    spec = SHAPES[shape]
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_TOKENS})
    ids = tokenizer.convert_tokens_to_ids(QWEN_TOKENS)
    text = {"vocab_size": len(tokenizer), "max_position_embeddings": 32768, "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
            "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24] if shape != "tiny" else [2, 3, 3]},
            **spec["text"]}
    vision = {"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_chans": 3, **spec["vision"]}
    config_class = Qwen2VLConfig if spec["model_type"] == "qwen2_vl" else Qwen2_5_VLConfig
    config = config_class(text_config=text, vision_config=vision, vision_start_token_id=ids[0],
                          vision_end_token_id=ids[1], image_token_id=ids[2], video_token_id=ids[3],
                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 1280).save_pretrained(directory)
    return directory


def _png_url(size: int, seed: int) -> str:
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size, size, 3), generator=generator, dtype=torch.uint8).numpy()
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


class Bench:
    """One model, one engine, the loader and the processor."""

    def __init__(self, directory: Path, device: torch.device, dtype: torch.dtype) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        hf = load_vision_model(directory, dtype, device)
        self.runner = VisionRunner(hf, num_blocks=1024, block_size=16)
        self.engine = Engine(self.runner, self.tokenizer, max_batch_size=2, max_model_len=8192, speculation=False)
        self.processor = self.runner.family.load_image_processor(directory)
        self.loader = ImageLoader(MediaLimits())
        self.device = device
        self.counter = 0

    def prompt(self, picture: Picture | None, pad_to: int = 0, salt: int = 0) -> tuple[list[int], object]:
        """One user turn: the image (if any), a question, ``pad_to`` filler words; ``salt`` makes a
        text prompt unique (so the prefix cache holds none of it)."""
        text = f"<|im_start|>user\n{salt} " + ("<|vision_start|><|image_pad|><|vision_end|>" if picture else "")
        text += "Describe it." + " filler" * pad_to + "<|im_end|>\n<|im_start|>assistant\n"
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if picture is None:
            return ids, None
        return expand_prompt(self.runner.family, self.tokenizer, self.processor, self.runner.hf.config, ids, [picture])

    def first_token_ms(self, ids: list[int], media) -> float:
        self.counter += 1
        done: list = []
        self.engine.submit(GenerationRequest(request_id=f"b{self.counter}", prompt_token_ids=ids, media=media,
                                             params=SamplingParams(temperature=0.0), max_tokens=1, ignore_eos=True,
                                             sink=done.append))
        started = time.perf_counter()
        while not (done and done[-1].finish_reason):
            self.engine.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - started) * 1e3

    def measure(self, size: int, seed: int) -> dict[str, float]:
        url = _png_url(size, seed)
        started = time.perf_counter()
        loaded = asyncio.run(self.loader.load(url, param="image"))
        decode = (time.perf_counter() - started) * 1e3
        picture = Picture(image=loaded.image, digest=loaded.digest)
        started = time.perf_counter()
        ids, media = self.prompt(picture)
        process = (time.perf_counter() - started) * 1e3
        encode_before = self.engine.vision.encode_s
        total = self.first_token_ms(ids, media)
        encode = (self.engine.vision.encode_s - encode_before) * 1e3
        _, again = self.prompt(picture)
        cached = self.first_token_ms(ids, again)
        salt = seed + 1
        text_ids, _ = self.prompt(None, pad_to=max(0, len(ids) - len(self.prompt(None, salt=salt)[0])), salt=salt)
        text = self.first_token_ms(text_ids, None)
        return {"tokens": len(ids), "image tokens": media.num_image_tokens, "decode": decode, "process": process,
                "encode": encode, "prefill": total - encode, "text prefill": text, "cached": cached}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(SHAPES), default="tiny")
    parser.add_argument("--sizes", type=int, nargs="+", default=[224, 448, 896])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="default: float32 for tiny, bfloat16 otherwise")
    args = parse_with_smoke(parser, argv, {"sizes": [56, 112], "repeat": 1}, "two small sizes, one run")
    from server.model_loader import default_model_dir, load_tokenizer

    dtype = getattr(torch, args.dtype or ("float32" if args.shape == "tiny" else "bfloat16"))
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        directory = write_model(args.shape, load_tokenizer(default_model_dir(show_progress=False)), Path(tmp), dtype)
        bench = Bench(directory, device, dtype)
        bench.measure(args.sizes[0], seed=0)  # warm-up
        rows = []
        for size in args.sizes:
            runs = [bench.measure(size, seed=1000 * size + r) for r in range(args.repeat)]
            row = {"shape": args.shape, "device": device.type, "size": f"{size}x{size}"}
            row.update({key: statistics.median(run[key] for run in runs) for key in runs[0]})
            rows.append(row)
        bench.loader.close()
    _print(rows)
    return rows


def _print(rows: list[dict]) -> None:
    columns = ["size", "tokens", "image tokens", "decode", "process", "encode", "prefill", "text prefill", "cached"]
    print(f"shape {rows[0]['shape']} on {rows[0]['device']} (ms, median)")
    print(" | ".join(f"{c:>12}" for c in columns))
    for row in rows:
        print(" | ".join(f"{row[c]:>12.1f}" if isinstance(row[c], float) else f"{row[c]!s:>12}" for c in columns))


if __name__ == "__main__":
    main()
