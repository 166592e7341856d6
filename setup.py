from setuptools import find_packages, setup

setup(
    name="optimus2d",
    version="0.1.0",
    description="2D (Optimus) and 2.5D (Tesseract) tensor parallelism for PyTorch",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["optimus2d", "optimus2d.*"]),
    python_requires=">=3.10",
    # The ranges CI tests at both ends (scripts/test.sh): torch 2.11.0 (.venv-torch211), 2.13.0
    # (.venv) and 2.15.0 (.venv-timm); transformers 5.23.0 and 5.25.0. Raise an upper bound only
    # after `bash scripts/test.sh --newest` passes. Installs here pin torch through constraints*.txt
    # (an unpinned torch pulls a CUDA build).
    install_requires=["torch>=2.11,<=2.15.0", "numpy", "einops", "tqdm"],
    extras_require={
        "mpi": ["mpi4py>=4", "mpich"],
        "test": ["pytest>=8", "pytest-mpi", "pytest-timeout", "ruff"],
        "families": ["transformers>=5.23,<=5.25.0"],  # converters for Hugging Face models (optional)
        "bench": ["matplotlib"],  # the benchmark report's plots (optional)
    },
)
