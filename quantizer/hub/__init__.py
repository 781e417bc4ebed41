"""Publishing to the Hugging Face Hub: the push (``push``) and the model card (``card``)."""
