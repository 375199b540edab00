# FreeToken on NVIDIA Triton Inference Server (Python backend).
#
#   docker build -t freetoken .
#   docker run --gpus all --shm-size=2g -p 8000:8000 -p 8001:8001 -p 8002:8002 \
#       -v /path/to/Qwen3.6-35B-A3B:/model:ro freetoken [--model /model plus engine flags, e.g. --max-running-requests 128]
#
# The entry point is `freetoken serve --model /model`: it writes the model repository from
# model_repository/freetoken with the engine flags as config.pbtxt parameters and runs the image's
# tritonserver (found on PATH, with the image's backends). To serve the embedded demo model instead,
# override the command: `docker run ... --entrypoint freetoken freetoken serve`. Docker's default
# 64 MB /dev/shm is too small for the Python backend: keep --shm-size at 1 GB or more.
ARG TRITON_VERSION=24.10
FROM nvcr.io/nvidia/tritonserver:${TRITON_VERSION}-py3

# The 24.10 (2.51) Python backend stub is built against numpy 1.x: under numpy 2 tensors arrive corrupted.
ARG NUMPY_SPEC="numpy<2"
WORKDIR /opt/freetoken
COPY pyproject.toml README.md ./
COPY backend backend
COPY kernels kernels
COPY model_repository model_repository
RUN python3 -m pip install --no-cache-dir . "${NUMPY_SPEC}" "tritonclient[grpc]>=2.51" \
 && python3 -c "import freetoken.serving.repository as r; print(r.template_dir())"

ENV FREETOKEN_CACHE=/var/cache/freetoken
EXPOSE 8000 8001 8002
ENTRYPOINT ["freetoken", "serve"]
CMD ["--model", "/model"]
