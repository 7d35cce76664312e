# P = the commit before the rank-side change (.ab/base2), N = this tree; interleaved, order swapped per run
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
B="python3 -m shmproxy.tools.bench"
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/base2_site .ab/base2 >/dev/null 2>&1 || echo "BASE2 BUILD FAILED"
for i in ${RUNS:-1 2 3 4 5 6}; do
  for side in $( [ $((i % 2)) = 0 ] && echo "P N" || echo "N P"); do
    PP=$PYTHONPATH; [ $side = P ] && PP=/tmp/base2_site:$PYTHONPATH
    MPI="timeout 100 mpirun -n 2 --allow-run-as-root --bind-to core -x PYTHONPATH=$PP"
    echo "run $i $side pp64 $($MPI $B pingpong --device cuda -b 64M -e 64M -n 2000 --peers none 2>&1 | grep -E '^ +[0-9]+ |rror')"
    echo "run $i $side ar8 $($MPI $B allreduce --device cuda -b 8 -e 8 -n 3000 --peers none 2>&1 | grep -E '^ +[0-9]+ |rror')"
    echo "run $i $side pp8 $($MPI $B pingpong --device cuda -b 8 -e 8 -n 3000 --peers none 2>&1 | grep -E '^ +[0-9]+ |rror')"
  done
done
