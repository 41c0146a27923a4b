"""The Llama-architecture decoder, its loader, presets and tokenizers.

Nothing is imported here: admission and the coordinator read a model's folder, tokenizer and chat template
without torch (tether/model/folder.py), so a package import must not pull in the decoder.
"""
