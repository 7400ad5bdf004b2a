# One image for every Skiff role; compose.yaml picks the role by its command.
#   docker build -t skiff .                                                  # CPU torch
#   docker build -t skiff:gpu --build-arg TORCH_INDEX_URL=https://pypi.org/simple .  # CUDA torch
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
# The CPU wheel index: a bare `pip install torch` would pull several GB of CUDA libraries.
# PyPI's Linux torch wheels are the CUDA build (compose.gpu.yaml builds with them).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SKIFF_MODEL=/models/SmolLM2-135M-Instruct.Q4_1.gguf

WORKDIR /app
# a C compiler: the CPU worker builds its kernels (shared/cpu) at first use, for the CPU it
# runs on
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

# The dependencies before the source, so that editing code does not reinstall them.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt

COPY shared ./shared
COPY services ./services
COPY tools ./tools
RUN pip install .

# Not root. /models is created here, owned by that user, so that a fresh named volume mounted
# there inherits the ownership and the `models` service can write into it.
RUN useradd --create-home skiff && mkdir /models && chown skiff /models
USER skiff

EXPOSE 8000 5555 5556
CMD ["python", "-m", "services.gateway", "--help"]
