"""Vision inputs: loading and checking the images of OpenAI ``image_url`` content parts."""
