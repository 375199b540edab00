# Sourced (not run) from the repository root by scripts/gpu_check.sh and scripts/bench.sh: the
# environment both run FreeToken in on the GPU machine, without a build.
#   - FreeToken from this checkout, copied into a fresh site folder $SITE (backend/freetoken as the
#     package `freetoken`, top-level kernels/ as `freetoken.kernels`), exported on PYTHONPATH;
#   - any wheel in .whl/ (git-ignored; e.g. the transformers CI uses) installed into $SITE first,
#     without dependencies or an index; a failure is logged to $GPU_SITE_LOG and does not stop;
#   - unbuffered Python, no tokenizers thread pool, no Hugging Face Hub access.
# Needs: $GPU_SITE_LOG (a file, appended to). Sets and exports: SITE, PYTHONPATH.
# PYTHON (default python3) is the interpreter that installs the wheels.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
SITE=$(mktemp -d)
export SITE
cp -r backend/freetoken "$SITE/freetoken" && rm -rf "$SITE/freetoken/kernels" && cp -r kernels "$SITE/freetoken/kernels"
if compgen -G ".whl/*.whl" >/dev/null; then
    "${PYTHON:-python3}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        || echo "wheel install failed" | tee -a "$GPU_SITE_LOG"
fi
export PYTHONPATH="$SITE"
