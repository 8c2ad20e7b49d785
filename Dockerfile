# rackfill: multi-stage image. The builder compiles the release binary; the runtime stage is slim.
#
#   docker build -t rackfill .                                   # debian slim: runs on the CPU
#   docker build -t rackfill:cuda --build-arg RUNTIME_BASE=nvidia/cuda:13.0.0-runtime-ubuntu24.04 .
#   docker build -t rackfill:cpu --build-arg "CARGO_FEATURES=--no-default-features --features mpi" .  # CPU-only binary
#   docker buildx build --platform linux/arm64 ...               # GB200 trays are Grace (aarch64) hosts
#
# Both images carry the same binary: the default build includes the GPU data plane, whose CUDA
# libraries (driver, NVRTC, cuBLAS) are loaded at run time. On the CUDA runtime base they are
# there (run with `--gpus all`); on debian slim the binary says so and serves on the CPU.
#   docker run -p 8000:8000 rackfill                             # serves the built-in model
#   docker run -p 8000:8000 -v /models/qwen3:/models/qwen3 rackfill serve --host 0.0.0.0 --model /models/qwen3
#
# The binary is built with the `mpi` feature (CARGO_FEATURES, default `--features mpi`): one process
# per EP rank under mpirun or `srun --mpi=pmix` (docs/deploy.md). The image carries the OpenMPI
# runtime, the ssh client and server that mpirun uses between Kubernetes pods, and the launch
# scripts of deploy/bin on PATH (rackfill-rank, rackfill-lws, rackfill-heartbeat-check):
#   docker run --gpus all --shm-size=8g --entrypoint mpirun rackfill -np 4 --bind-to none rackfill serve --host 0.0.0.0
#
# The hf-hub cache is a volume at /data/hf (HF_HOME), so a model downloaded once is reused; the
# built-in model is compiled into the binary and needs no volume. No network is used at run time.

ARG RUNTIME_BASE=debian:bookworm-slim

FROM rust:1.95-bookworm AS builder
ARG CARGO_FEATURES="--features mpi"
# The mpi crate binds the system OpenMPI: its headers and mpicc (libopenmpi-dev), found through
# pkg-config, with bindgen's libclang (libclang-dev).
RUN apt-get update \
    && apt-get install -y --no-install-recommends libopenmpi-dev libclang-dev pkg-config \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin rackfill ${CARGO_FEATURES} \
    && strip target/release/rackfill

FROM ${RUNTIME_BASE} AS runtime
# openmpi-bin: mpirun, orted and the MPI library (libopenmpi3 on Debian 12, libopenmpi3t64 on
# Ubuntu 24.04: the dependency picks the right one for either RUNTIME_BASE). openssh-client and
# openssh-server: mpirun starts the ranks of other pods over ssh (deploy/bin/rackfill-lws).
# The user's shell runs orted for those ssh sessions, hence bash.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates curl openmpi-bin \
       openssh-client openssh-server \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --create-home --shell /bin/bash --uid 10001 rackfill \
    && mkdir -p /data/hf /models \
    && chown rackfill /data/hf /models
COPY --from=builder /src/target/release/rackfill /usr/local/bin/rackfill
COPY deploy/bin/ /usr/local/bin/
USER rackfill
ENV HF_HOME=/data/hf \
    RUST_LOG=info
VOLUME ["/data/hf", "/models"]
# 8000: the HTTP API (rank 0 only, under MPI); 2222: a worker pod's sshd (rackfill-lws worker).
EXPOSE 8000 2222
HEALTHCHECK --interval=15s --timeout=3s --start-period=30s --retries=3 \
    CMD curl -fsS http://127.0.0.1:8000/health || exit 1
ENTRYPOINT ["rackfill"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
