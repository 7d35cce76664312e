"""What the device kernels of both processes share: the element types they are written for and the
reduction each op stands for, as CUDA C.

The progress process's fused reduction (shmproxy.transports.cuda_coll) and the ranks' own Allreduce kernels
(shmproxy.rank.devcoll) combine the same values in the same order with these expressions, so a
collective's result has the same bits whichever of them ran it.
"""
from __future__ import annotations

from shmproxy.core.ops import ReduceOp

C_TYPES = {"int8": "signed char", "uint8": "unsigned char", "int16": "short", "uint16": "unsigned short",
           "int32": "int", "uint32": "unsigned int", "int64": "long long", "uint64": "unsigned long long",
           "float32": "float", "float64": "double"}
# a: the value so far, b: the next rank's (NaN propagates through MIN and MAX, as in numpy and torch);
# AVG sums, then divides by the count of ranks (``AVG_FINISH``)
REDUCE_EXPR: dict[int, str] = {ReduceOp.SUM: "a + b", ReduceOp.AVG: "a + b", ReduceOp.PROD: "a * b",
                               ReduceOp.MIN: "(a != a || a < b) ? a : b", ReduceOp.MAX: "(a != a || a > b) ? a : b"}
AVG_FINISH = "a = a / (T)%d;"
