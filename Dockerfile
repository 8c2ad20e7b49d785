# rackfill: multi-stage image. The builder compiles the release binary; the runtime stage is slim.
#
#   docker build -t rackfill .                                   # debian slim: runs on the CPU
#   docker build -t rackfill:cuda --build-arg RUNTIME_BASE=nvidia/cuda:13.0.0-runtime-ubuntu24.04 .
#   docker build -t rackfill:cpu --build-arg CARGO_FEATURES=--no-default-features .   # CPU-only binary
#
# Both images carry the same binary: the default build includes the GPU data plane, whose CUDA
# libraries (driver, NVRTC, cuBLAS) are loaded at run time. On the CUDA runtime base they are
# there (run with `--gpus all`); on debian slim the binary says so and serves on the CPU.
#   docker run -p 8000:8000 rackfill                             # serves the built-in model
#   docker run -p 8000:8000 -v /models/qwen3:/models/qwen3 rackfill serve --host 0.0.0.0 --model /models/qwen3
#
# The hf-hub cache is a volume at /data/hf (HF_HOME), so a model downloaded once is reused; the
# built-in model is compiled into the binary and needs no volume. No network is used at run time.

ARG RUNTIME_BASE=debian:bookworm-slim

FROM rust:1.95-bookworm AS builder
ARG CARGO_FEATURES=""
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin rackfill ${CARGO_FEATURES} \
    && strip target/release/rackfill

FROM ${RUNTIME_BASE} AS runtime
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates curl \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --create-home --uid 10001 rackfill \
    && mkdir -p /data/hf /models \
    && chown rackfill /data/hf /models
COPY --from=builder /src/target/release/rackfill /usr/local/bin/rackfill
USER rackfill
ENV HF_HOME=/data/hf \
    RUST_LOG=info
VOLUME ["/data/hf", "/models"]
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=3s --start-period=30s --retries=3 \
    CMD curl -fsS http://127.0.0.1:8000/health || exit 1
ENTRYPOINT ["rackfill"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
