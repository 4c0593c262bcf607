"""Vision-language models: image embeddings spliced into the language model's prefill.

The HTTP side turns images into a :class:`PromptMedia` (processed pixels, the placeholder spans
in the prompt, M-RoPE positions); the engine encodes each image once, when a prefill step first
reaches its span (:class:`StepVision`), and the :class:`VisionRunner` writes the embeddings over
the placeholder tokens' own. Decode steps are plain text steps.
"""

from server.engine.vision.families import FAMILIES, VisionFamily, family_for, vision_model_type
from server.engine.vision.media import ImageInput, PromptMedia, StepMedia

__all__ = ["FAMILIES", "ImageInput", "PromptMedia", "StepMedia", "VisionFamily", "family_for", "vision_model_type"]
