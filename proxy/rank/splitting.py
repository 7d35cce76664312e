"""Split of a communicator whose ranks span nodes (rank side; Comm.Split calls it).

The members of a color that run on one node share that node's progress process for the child, so
the child's local ranks are the members on this node, in child rank order. A child whose members
all run on one node is a one-node communicator like any other. A child that spans nodes needs what
the world got from the job's rendezvous (which node each member is on, where each node's new
progress process listens, a secret): the parent communicator itself is the rendezvous, through one
more Allgather of a fixed-size row per rank. Every rank of the parent takes part in it, whatever its
color and whether or not its own child spans nodes, so that the parent's sequence of collectives
stays the same on every rank.

The child's secret is derived from the parent's and the child's id: only members of the parent know
it, and two children never share one.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

from shmproxy.control import bootstrap
from shmproxy.core import errors

ROW = 512   # bytes per rank in the layout Allgather: a length and a small JSON object


class ChildLayout:
    """What a child communicator's ranks learn of its nodes; called by the rank's start with the
    connect-info of its node's new progress process (Lifecycle._meet_nodes)."""

    def __init__(self, layouts: "ChildLayouts", members: list[int], spans_nodes: bool, child_id: int):
        self.layouts, self.members, self.spans_nodes, self.child_id = layouts, members, spans_nodes, child_id

    def __call__(self, net_info: bytes) -> dict:
        rows = self.layouts.exchange(net_info)
        parent = self.layouts.parent_layout
        parent_nodes = [parent["rank_node"][r] for r in self.members]
        order: list[int] = []
        for n in parent_nodes:
            if n not in order:
                order.append(n)
        rank_node = [order.index(n) for n in parent_nodes]
        infos = []
        for k, n in enumerate(order):
            first = self.members[parent_nodes.index(n)]
            info = rows[first]
            if not info:
                raise errors.InvalidUsage(f"Split: parent rank {first} sent no address for the child's node {k}")
            infos.append(info.hex())
        secret = hashlib.blake2b(bytes.fromhex(parent["secret"]) + self.child_id.to_bytes(8, "little"),
                                 digest_size=16).hexdigest()
        me = self.members.index(self.layouts.parent.rank)
        return {"node": rank_node[me], "rank_node": rank_node, "hosts": [parent["hosts"][n] for n in order],
                "infos": infos, "secret": secret}


class ChildLayouts:
    def __init__(self, parent: Any, table: np.ndarray):
        self.parent, self.table = parent, table
        self.parent_layout: dict = parent.node_layout

    def members(self, color: int) -> list[int]:
        """The parent ranks of ``color``, in the child's rank order (key, then parent rank)."""
        t = self.table
        return [r for _k, r in sorted((int(t[r, 1]), r) for r in range(len(t)) if t[r, 0] == color)]

    def child_info(self, color: int, child_id: int) -> tuple[bootstrap.LaunchInfo, ChildLayout]:
        members = self.members(color)
        rank_node = self.parent_layout["rank_node"]
        here = [r for r in members if rank_node[r] == rank_node[self.parent.rank]]
        me = members.index(self.parent.rank)
        info = bootstrap.LaunchInfo(rank=me, size=len(members), local_rank=here.index(self.parent.rank),
                                    local_size=len(here), launcher="split")
        return info, ChildLayout(self, members, len(here) < len(members), child_id)

    def exchange(self, blob: bytes) -> list[bytes]:
        """This rank's share of the layout Allgather over the parent (see the module header)."""
        payload = json.dumps({"net": blob.hex()}).encode()
        if len(payload) + 2 > ROW:
            raise errors.InternalError(f"Split: a node's connect-info of {len(blob)} bytes does not fit a row")
        row = np.zeros(ROW, np.uint8)
        row[:2] = np.frombuffer(len(payload).to_bytes(2, "little"), np.uint8)
        row[2:2 + len(payload)] = np.frombuffer(payload, np.uint8)
        out = np.zeros((self.parent.size, ROW), np.uint8)
        self.parent.Allgather(row, out)
        rows = []
        for r in range(self.parent.size):
            n = int.from_bytes(out[r, :2].tobytes(), "little")
            rows.append(bytes.fromhex(json.loads(out[r, 2:2 + n].tobytes())["net"]) if n else b"")
        return rows
