"""offpolicy_jax: JAX-native off-policy reinforcement learning for language models."""

import setuptools

# Versions below are the ones the test suite was run against; flax NNX, orbax
# and grain change APIs between releases, so the core stack is pinned.
INSTALL_REQUIRES = [
    "jax==0.10.2",
    "jaxlib==0.10.2",
    "flax==0.12.8",
    "optax==0.2.8",
    "orbax-checkpoint==0.12.8",
    "grain==0.2.18",
    "absl-py==2.5.1",
    "ml-collections==1.1.0",
    "numpy>=2.0,<3",
    "safetensors==0.8.0",
    "tokenizers==0.23.3",
    # `config.model=org/name`: a Hugging Face repo id, downloaded or read from the cache.
    "huggingface_hub==2.4.0",
    "jinja2>=3.1",
    "tensorboardX==2.6.5",
    "matplotlib>=3.9",
    "tqdm>=4.66",
    # The workdir lock (an OS-level lock, released when its holder dies).
    "filelock==4.2.11",
    # seccomp filters of the verifier sandbox (ctypes binding to the system's libseccomp).
    "pyseccomp==0.1.2; sys_platform == 'linux'",
]

EXTRAS_REQUIRE = {
    # Viewers of the metrics a run writes (docs/metrics.md): `tensorboard --logdir=WORKDIR/tb`,
    # and Weights & Biases (`--config.wandb_project=NAME`).
    "tensorboard": ["tensorboard>=2.16"],
    "wandb": ["wandb>=0.19"],
    "tasks": [
        "reasoning-gym==0.1.25",
        "math-verify==0.9.0",
        "pyarrow>=15",
    ],
    # Loading an export in the Hugging Face ecosystem (docs/getting_started.md#exporting):
    # AutoModelForCausalLM / AutoTokenizer on a merged export, peft on an adapter.
    "hf": [
        "torch==2.13.0",
        "transformers==5.24.0",
        "peft==0.21.2",
        "safetensors==0.8.0",
    ],
    "test": [
        "pytest>=8",
        "pytest-xdist>=3.5",
        # The launcher tests parse the generated JobSet YAML.
        "pyyaml>=6",
        # Tree and shape assertions in the tests (the library does not import it).
        "chex==0.1.92",
        # The CPU wheel of this exact release is what the parity tests use.
        "torch==2.13.0",
        "transformers>=4.50",
        # The LoRA round trip (tests/test_lora.py): our adapters loaded by peft onto HF.
        "peft==0.21.2",
        # GAE, V-trace and Retrace are checked against DeepMind's reference (tests/test_returns.py).
        "rlax==0.1.9",
        # distrax (rlax's dependency) takes tfp-nightly unpinned: pinned to the tested build.
        "tfp-nightly==0.26.0.dev20261027",
        "nbformat>=5.10",
        "nbclient>=0.10",
        "ipykernel>=6",
        "ruff==0.17.6",
        "mypy==2.4.1",
        # The layers contract of the wings (pyproject.toml), run in CI.
        "import-linter==2.17",
        "reasoning-gym==0.1.25",
        "math-verify==0.9.0",
        "pyarrow>=15",
    ],
}

setuptools.setup(
    name="offpolicy_jax",
    version="0.2.0",
    description="JAX-native off-policy RL for large language models.",
    # The binaries (`python -m experiments.train`) and the configs they name
    # (`--config=configs/default.py`) install too, so both work from any directory.
    packages=setuptools.find_packages(
      include=["offpolicy_jax", "offpolicy_jax.*", "experiments", "configs"]
    ),
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
)
