# Session 24, ninth call (2x H200): armed routes with one rank per GPU (SPTEST_GPU_SPREAD=1), and the
# multi-GPU suite, on the final code.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
python3 -m pip install -q --no-deps --no-build-isolation -e . >$OUT/install.log 2>&1 || exit 1
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
SPTEST_GPU_SPREAD=1 timeout 150 python3 -m pytest -p no:cacheprovider -q -rs tests/test_gpu.py -k armed 2>&1 \
    | tail -30 | tee $OUT/t_armed_spread.log
timeout 250 python3 -m pytest -p no:cacheprovider -q -rs tests/test_gpu_multi.py 2>&1 | tail -6 | tee $OUT/t_multi.log
ls /dev/shm
