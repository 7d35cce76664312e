# Session 23, sixth call (1x H200; the 2-GPU kind was not lent then): tests/test_gpu.py on the final
# tree, ops unpacked in C included, and the count of cuda.shm files after it.
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
timeout 200 python3 -m pytest -p no:cacheprovider -q -rs tests/test_gpu.py > $OUT/t_gpu.log 2>&1
echo "gpu rc=$? $(tail -1 $OUT/t_gpu.log)"; echo "cuda.shm files: $(ls /dev/shm | grep -c cuda.shm)"
