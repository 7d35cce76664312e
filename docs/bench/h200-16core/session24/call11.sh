# Session 24, eleventh call (1x H200): the armed-route GPU tests after the last change to the engine
# side (claims recorded before held halves go into matching), and one 64 MiB ping-pong.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
python3 -m pip install -q --no-deps --no-build-isolation -e . >$OUT/install.log 2>&1 || exit 1
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 CUDA_VISIBLE_DEVICES=0
timeout 120 python3 -m pytest -p no:cacheprovider -q -rs tests/test_gpu.py -k "armed or repeated" 2>&1 | tail -4 \
    | tee $OUT/t_armed.log
timeout 60 mpirun -n 2 --bind-to core -x PYTHONPATH -x CUDA_VISIBLE_DEVICES python3 -m shmproxy.tools.bench \
    pingpong --device cuda -b 64M -e 64M -n 2000 --peers none 2>&1 | grep -E "^ +67108864" | tee $OUT/pingpong64.log
ls /dev/shm
