"""Where a base model comes from (layer 2): the embedded tiny default and its synthetic review
corpus, GGUF files, the Hugging Face cache."""
