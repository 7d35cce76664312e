"""Ping-pong 64 MiB between 2 ranks on one GPU, then the progress process's armed-route counts."""
import sys, time, json, os, subprocess
import cupy as cp
import shmproxy
n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
with shmproxy.init() as comm:
    me = comm.rank
    a, b = cp.zeros(64 << 18, cp.float32), cp.zeros(64 << 18, cp.float32)
    for rnd in range(2):
        comm.Barrier()
        t = time.perf_counter()
        for i in range(n):
            if me == 0:
                comm.Send(a, 1, tag=1); comm.Recv(b, 1, tag=1)
            else:
                comm.Recv(b, 0, tag=1); comm.Send(a, 0, tag=1)
        dt = (time.perf_counter() - t) / (2 * n) * 1e6
        if me == 0:
            print(f"round {rnd}: one way {dt:.1f} us", flush=True)
    comm.Barrier()
    if me == 0:
        cmd = [sys.executable, "-m", "shmproxy.tools.dump_cli", "--pid", str(comm._proxy_pid), "--json",
               "--signal"]
        doc = json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout)
        p = doc["processes"][0]; os.unlink(p["dump_file"])
        print("armed:", p["state"]["in_process"]["armed_routes"], flush=True)
    comm.Barrier()
