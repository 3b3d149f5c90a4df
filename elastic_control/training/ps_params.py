"""A trainer's hold on the parameter servers' values: the dense parameters (pull, push, snapshot, load from a
pass), its sparse pushes (flush) and the one sparse table (save and load address it).

Everything here reaches into Paddle 2.6's ``TheOnePSRuntime`` (``fleet.fleet._runtime_handle``): in its
a_sync mode with ``exe.run`` nothing else pulls the dense parameters back or pushes a changed value.
"""

from __future__ import annotations

import numpy as np

from ctr_foundation.pass_format import load_pass


class PsParameters:
    def __init__(self, paddle, fleet, exe, place, dense_names: list[str]):
        self.paddle, self.fleet, self.exe, self.place = paddle, fleet, exe, place
        self.dense_names = list(dense_names)
        self._ctx = None  # (runtime, dense receive map): after init_worker (connect)

    @property
    def _runtime(self):
        return self.fleet.fleet._runtime_handle

    def connect(self) -> None:
        """After ``fleet.init_worker()``: the dense tables' receive context that pull and push use."""
        from paddle.distributed.ps.utils.public import get_the_one_recv_context

        rt = self._runtime
        self._ctx = rt, get_the_one_recv_context(rt.context, split_dense_table=rt.is_heter_ps_mode)

    def pull_dense(self) -> None:
        """Refresh the local dense parameters from the servers.

        In 2.6.2's a_sync mode with ``exe.run`` the trainers push dense gradients
        (send ops) but nothing pulls the updated parameters back (the
        communicator that would is only created in GEO mode): without this,
        every trainer would keep its initial MLP for ever.
        """
        rt, dense_map = self._ctx
        rt._pull_all_dense(rt.scopes, rt._send_ctx, dense_map)

    def push_dense(self, values: dict) -> None:
        """Make ``values`` the dense parameters, here and on the servers (trainer 0, the others waiting)."""
        scope = self.paddle.static.global_scope()
        for name, value in values.items():
            scope.find_var(name).get_tensor().set(value, self.place)
        rt, dense_map = self._ctx
        rt._init_all_params(rt.scopes, rt._send_ctx, dense_map)

    def dense_snapshot(self) -> dict:
        scope = self.paddle.static.global_scope()
        return {n: np.array(scope.find_var(n).get_tensor()).copy() for n in self.dense_names}

    def load_dense_from_pass(self, pass_dir: str) -> str:
        """Set the local dense parameters to a pass's (before init_worker pushes them); returns its prefix."""
        paddle = self.paddle
        prefix = str(load_pass(pass_dir).dense_model_prefix)
        scope = paddle.static.Scope()
        with paddle.static.scope_guard(scope):
            paddle.static.load_inference_model(prefix, self.exe)
        glob = paddle.static.global_scope()
        for name in self.dense_names:
            glob.find_var(name).get_tensor().set(np.array(scope.find_var(name).get_tensor()), self.place)
        return prefix

    def flush_pushes(self) -> None:
        """Make sure this trainer's asynchronous sparse pushes reached the servers."""
        self._runtime._worker.client_flush()

    def sparse_table(self):
        """(the PS client, the id of the one sparse table): what saves and loads of the table address."""
        rt = self._runtime
        (table_id,) = {ctx.table_id() for ctx in rt._send_ctx.values() if ctx.is_sparse()}
        return rt._worker, table_id
