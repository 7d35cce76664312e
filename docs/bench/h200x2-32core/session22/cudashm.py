"""Which CUDA uses leave /dev/shm/cuda.shm.* behind: one child process per case, listing after each."""
import os, subprocess, sys, signal, time

CASES = {
    "context only": "import cupy as cp; cp.zeros(1).sum()",
    "ipc mem handle": "import cupy as cp; a=cp.zeros(1<<20); cp.cuda.runtime.ipcGetMemHandle(a.data.ptr)",
    "ipc event, destroyed": "import cupy as cp, gc; e=cp.cuda.Event(block=False,disable_timing=True,interprocess=True); "
                            "cp.cuda.runtime.ipcGetEventHandle(e.ptr); del e; gc.collect()",
    "ipc event, kept to exit": "import cupy as cp; e=cp.cuda.Event(block=False,disable_timing=True,interprocess=True); "
                               "h=cp.cuda.runtime.ipcGetEventHandle(e.ptr)",
    "ipc event, os._exit": "import cupy as cp, os; e=cp.cuda.Event(block=False,disable_timing=True,interprocess=True); "
                           "h=cp.cuda.runtime.ipcGetEventHandle(e.ptr); os._exit(0)",
    "ipc event, no handle taken": "import cupy as cp; e=cp.cuda.Event(block=False,disable_timing=True,interprocess=True)",
}


def shm():
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith("cuda.shm"))


before = shm()
print("before:", before)
for name, code in CASES.items():
    p = subprocess.run([sys.executable, "-c", code + "; import os; print(os.getpid())"], capture_output=True, text=True)
    now = shm()
    print(f"{name}: rc {p.returncode} pid {p.stdout.strip()} new {sorted(set(now) - set(before))} {p.stderr[-200:]}")
    before = now
# killed -9 while holding an event
p = subprocess.Popen([sys.executable, "-c", CASES["ipc event, kept to exit"] + "; import time; print('up', flush=True); time.sleep(60)"],
                     stdout=subprocess.PIPE, text=True)
p.stdout.readline()
p.kill(); p.wait()
now = shm()
print(f"ipc event, kill -9: pid {p.pid} ({p.pid:x}) new {sorted(set(now) - set(before))}")
