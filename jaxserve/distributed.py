"""Multi-host tensor parallelism: ``jax.distributed`` and the step stream from host 0.

JAX runs one process per host ("multi-controller"): each process drives its own devices, and
every process must run the same compiled programs in the same order, with the same inputs, for
their collectives to meet. So host 0 runs the whole engine (the HTTP server or ``LLM``, the
scheduler, the model runner) and every other host runs a follower (``EngineCore.follow``): the
same model runner, fed the ``SchedulerOutput`` of each step host 0 executes, so its persistent
batch, its inputs and its programs stay identical to host 0's. This is vLLM's multi-node shape
(the driver broadcasts each SchedulerOutput to the workers); the channel is the key-value store
of ``jax.distributed``'s coordinator, which already connects the processes.

Flags (``EngineConfig``): ``--num-hosts K`` (> 1 turns this on), ``--host-id i`` and
``--distributed-coordinator host:port`` (host 0's address; left out, ``jax.distributed.initialize``
detects the cluster from its environment: SLURM, Open MPI, Kubernetes, ...).
"""

from __future__ import annotations

import msgspec

from jaxserve.config import EngineConfig
from jaxserve.core.scheduler_output import SchedulerOutput

# A follower waits this long for the next step before asking again (an idle server sends none).
_POLL_MS = 60_000
_KEY = "jaxserve/step/{host}/{n}"


def check_hosts(config: EngineConfig) -> None:
    """Raises ValueError naming the flag when --host-id is not below --num-hosts."""
    if not 0 <= config.host_id < config.num_hosts:
        raise ValueError(f"--host-id {config.host_id} must be below --num-hosts {config.num_hosts}")


def initialize(config: EngineConfig) -> None:
    """``jax.distributed.initialize`` for ``--num-hosts`` > 1; call before JAX starts a backend.
    Host 0 starts the coordinator service at ``--distributed-coordinator``; every host then sees
    all hosts' devices in ``jax.devices()``, so the tensor-parallel mesh can span them.

    Raises:
      ValueError: as ``check_hosts``.
    """
    if config.num_hosts == 1:
        return
    import jax

    check_hosts(config)
    jax.distributed.initialize(coordinator_address=config.distributed_coordinator,
                               num_processes=config.num_hosts, process_id=config.host_id)


def check_mesh_spans_hosts(mesh, num_hosts: int) -> None:
    """Raises ValueError naming the flags when the tensor-parallel mesh (None: one device) leaves
    out a host's devices: every host runs the same steps, so each must hold part of the model."""
    hosts = {0} if mesh is None else {d.process_index for d in mesh.devices.flat}
    if len(hosts) < num_hosts:
        raise ValueError(f"--tensor-parallel-size {1 if mesh is None else mesh.size} takes the "
                         f"devices of {len(hosts)} of the --num-hosts {num_hosts} hosts; raise it "
                         f"so that the mesh spans every host")


def min_over_hosts(value: int, mesh) -> int:
    """The smallest of every host's ``value`` (an int32), through the mesh: each device holds
    its host's value, one jitted min gathers them. (``multihost_utils.process_allgather`` fails
    when hosts hold different numbers of the mesh's devices.)"""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxserve.models.sharding import AXIS, replicated

    values = jax.make_array_from_callback(
        (mesh.size,), NamedSharding(mesh, P(AXIS)), lambda index: np.full(1, value, np.int32))
    smallest = jax.jit(jax.numpy.min, out_shardings=replicated(mesh))(values)
    return int(smallest.addressable_data(0))


def _encode_bitmask(array):
    """msgspec's hook for the one numpy array a SchedulerOutput holds (``grammar_bitmask``,
    [rows, words] int32): (rows, words, its bytes)."""
    import numpy as np

    if not isinstance(array, np.ndarray):
        raise NotImplementedError(f"cannot encode {type(array).__name__}")
    return [array.shape[0], array.shape[1], np.ascontiguousarray(array, np.int32).tobytes()]


def _decode_bitmask(kind, obj):
    import numpy as np

    rows, words, data = obj
    return np.frombuffer(data, np.int32).reshape(rows, words).copy()


class StepChannel:
    """Host 0 -> hosts 1..K-1: the SchedulerOutput of every step, in order (None: shut down).

    Messages are msgpack (msgspec, typed on decode) under one key per follower and step in the
    coordinator's key-value store; each follower deletes its key once read.
    """

    def __init__(self, num_hosts: int, host_id: int):
        from jax._src import distributed  # the coordinator's client; no public handle exists

        self._client = distributed.global_state.client
        self._followers = range(1, num_hosts)
        self._host = host_id
        self._n = 0
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_encode_bitmask)
        self._decoder = msgspec.msgpack.Decoder(SchedulerOutput | None, dec_hook=_decode_bitmask)

    def publish(self, sched: SchedulerOutput | None) -> None:
        """Host 0: send one step (or None, the end) to every follower."""
        data = self._encoder.encode(sched)
        for host in self._followers:
            self._client.key_value_set_bytes(_KEY.format(host=host, n=self._n), data)
        self._n += 1

    def receive(self) -> SchedulerOutput | None:
        """A follower: the next step host 0 published (blocks until there is one)."""
        import jax

        key = _KEY.format(host=self._host, n=self._n)
        while True:
            try:
                data = self._client.blocking_key_value_get_bytes(key, _POLL_MS)
                break
            except jax.errors.JaxRuntimeError as e:
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
        self._client.key_value_delete(key)
        self._n += 1
        return self._decoder.decode(data)
