#!/bin/bash
# A/B on the device: scratch/old vs scratch/new python files, interleaved pairs.
cd "$(dirname "$0")/.."
R=${OUT:-./out}; mkdir -p $R/ab
ONLY=setup-only OUT=$R/setup bash tools/device_bench.sh > $R/setup.log 2>&1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
L="mpirun --allow-run-as-root --oversubscribe --bind-to core -x PYTHONPATH -x PYTHONUNBUFFERED"
PAIRS=${PAIRS:-3}
for i in $(seq 1 $PAIRS); do
  for v in old new; do
    cp -r scratch/$v/* .
    timeout 90 $L -n 2 python3 -m proxy.bench pingpong -b 1M -e 16M -f 2 -n 300 -r 3 --peers mpi4py --json $R/ab/pp_${v}_$i.json > $R/ab/pp_${v}_$i.txt 2>&1
    timeout 120 $L -n 8 python3 -m proxy.bench allreduce -b 1M -e 16M -f 2 -n 100 -r 3 --peers mpi4py --json $R/ab/ar8_${v}_$i.json > $R/ab/ar8_${v}_$i.txt 2>&1
    timeout 120 $L -n 8 python3 -m proxy.bench overlap -b 256K -e 4M -f 4 --peers none --json $R/ab/ov8_${v}_$i.json > $R/ab/ov8_${v}_$i.txt 2>&1
    echo "pair $i $v done $(date +%T)"
  done
done
cp -r scratch/new/* .
tar czf $R/ab.tgz -C $R ab setup.log
rm -rf $R/ab $R/setup
