#!/bin/bash
# device: small collectives at 8 ranks, the committed small path (old: scratch/oldtree) against the new one
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
REPO=$PWD; cd /tmp  # sys.path[0] is the cwd: keep it neutral so that PYTHONPATH decides
for r in 1 2; do
 for op in bcast reduce allgather reduce_scatter alltoall allreduce; do
  for side in old new; do
   if [ $side = old ]; then PP=$REPO/scratch/oldtree:$REPO; else PP=$REPO; fi
   line=$(PYTHONPATH=$PP timeout 100 mpirun -n 8 --allow-run-as-root --oversubscribe --bind-to core -x PYTHONPATH \
       python3 -m proxy.bench $op -b 8 -e 64K -f 8 -n 1000 ${PEERS:+--peers $PEERS} 2>&1 | grep -E "^ +[0-9]+ " | awk '{printf "%s:%s ", $1, $4}')
   echo "$r $op $side $line"
  done
 done
done | tee $OUT/smallcoll.txt
