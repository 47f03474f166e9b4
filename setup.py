"""megatron_ext: a Megatron-style 3D-parallel GPT pretraining framework on megatron-core."""

from setuptools import find_packages, setup

setup(
    name="megatron-ext",
    version="0.1.0",
    description="Megatron-style TP x PP x VPP x DP GPT pretraining on megatron-core, with varlen "
    "packing, negotiated padding, token-sum loss and a CPU/gloo platform layer",
    python_requires=">=3.11",
    packages=find_packages(include=["megatron_ext", "megatron_ext.*", "tools", "tools.*"]),
    package_data={"megatron_ext.planning": ["calibration.json"]},  # the memory model's measured coefficients
    py_modules=["pretrain_gpt"],
    install_requires=[
        # On CPU-only machines install torch==2.13.0 (the CPU build) first: a bare torch
        # requirement with no torch installed pulls a multi-GB CUDA build.
        "torch>=2.6",
        "megatron-core==0.16.1",  # compat.CHECKED_MEGATRON_CORE_VERSION
        "numpy",
        "sentencepiece",
        "pyyaml",
        "tqdm",
        "xxhash",  # checkpoint checksums (CRC-32 from zlib when it is missing)
    ],
    extras_require={
        "logging": ["tensorboard", "wandb"],
        "plots": ["matplotlib"],
        "convert": ["safetensors", "transformers"],
        # --tokenizer-type HuggingFaceTokenizer / GPT2BPETokenizer
        "hf": ["transformers", "tokenizers"],
        # --tokenizer-type TikTokenizer (megatron-core's, Megatron's tiktoken .json vocabulary)
        "tiktoken": ["tiktoken"],
        # ruff pinned: a new release adds rules and changes formatting (ruff.toml, scripts/test.sh).
        "test": [
            "pytest",
            "ruff==0.17.5",
            "tensorboard",
            "wandb",
            "matplotlib",
            "safetensors",
            "transformers",
            "tokenizers",
            "tiktoken",
        ],
        # GPU clusters: Transformer Engine layer spec and kernels (needs CUDA to build).
        "gpu": ["transformer-engine[pytorch]"],
    },
)
