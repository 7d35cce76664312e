"""Wake-up latencies from a perf trace, by wakee name, same CPU or cross, with or without an IPI:
(waking -> wakeup) is time in the waker's try_to_wake_up (the IPI's exit to the hypervisor shows
here), (wakeup -> run) the wait until the wakee ran. p10 / p50 / p90 in us. Twelfth session:

  perf record -k CLOCK_MONOTONIC -e sched:sched_waking,sched:sched_wakeup,sched:sched_switch,ipi:ipi_send_cpu \
      -a -o pp.data -- mpiexec -n 2 python ../session8/pp.py 4194304 300 perf 1000
  perf script -i pp.data > pp.txt; python3 wakeups.py pp.txt
"""
import re, sys, collections
import numpy as np
pat = re.compile(r'^\s*(\S+)\s+(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+(\S+):\s+(.*)$')
waking = {}; ipi_pending = {}; woke = {}; lat = collections.defaultdict(list)
last_waking_by_cpu = {}
for line in open(sys.argv[1]):
    m = pat.match(line)
    if not m: continue
    comm, pid, cpu, t, ev, rest = m.groups(); t = float(t)*1e6; cpu = int(cpu)
    if ev == 'sched:sched_waking':
        p = int(re.search(r'pid=(\d+)', rest).group(1)); c = re.search(r'comm=(\S+)', rest).group(1)
        tc = int(re.search(r'target_cpu=(\d+)', rest).group(1))
        waking[p] = [t, c, tc, cpu, False, None]; last_waking_by_cpu[cpu] = p
    elif ev == 'ipi:ipi_send_cpu':
        p = last_waking_by_cpu.get(cpu)
        if p in waking and waking[p][5] is None: waking[p][4] = True
    elif ev == 'sched:sched_wakeup':
        p = int(re.search(r'pid=(\d+)', rest).group(1))
        if p in waking: waking[p][5] = t
    elif ev == 'sched:sched_switch':
        p = int(re.search(r'next_pid=(\d+)', rest).group(1))
        if p in waking:
            t0, c, tc, wcpu, ipi, t1 = waking.pop(p)
            if t1 is None: continue
            lat[(c, 'samecpu' if wcpu == cpu else 'cross', 'ipi' if ipi else 'noipi')].append((t1 - t0, t - t1))
for k, v in sorted(lat.items()):
    v = np.array(v)
    print(k, len(v), 'waking->wakeup', np.percentile(v[:,0], [10,50,90]).round(1), 'wakeup->run', np.percentile(v[:,1], [10,50,90]).round(1))
