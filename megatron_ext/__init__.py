"""Extensions to megatron-core for CPU/gloo GPT pretraining."""
