"""dpfast with other libraries. Each submodule imports its library when it is imported itself (never before):
``dpfast.integrations.transformers`` holds :class:`DataParallelTrainer`, a Hugging Face ``Trainer`` on dpfast."""
