"""The API end of the pipe (core_client._Pipe, _frame) speaks multiprocessing.Connection's
framing, which the engine process reads and writes with: frames of every size survive, in order,
however the stream is cut into reads."""

import os
import random
import socket
import threading
from multiprocessing.connection import Connection

from jaxserve.engine.core_client import _frame, _Pipe


def test_frames_cross_both_ways_whatever_the_reads():
    api, engine = socket.socketpair()
    conn = Connection(engine.detach())
    rng = random.Random(0)
    frames = [os.urandom(rng.choice([0, 1, 5, 100, 3000, 70_000])) for _ in range(200)]
    sender = threading.Thread(target=lambda: [conn.send_bytes(f) for f in frames])
    sender.start()
    got = []
    pipe = _Pipe(got.append, lambda: None)
    while len(got) < len(frames):
        data = api.recv(rng.randint(1, 9000))
        assert data
        pipe.data_received(data)
    sender.join()
    assert got == frames and not pipe._buf
    for f in frames[:20]:
        api.sendall(_frame(f))
    assert [conn.recv_bytes() for _ in frames[:20]] == frames[:20]
    api.close()
    conn.close()
