"""Two hosts, one model (docs/parallelism.md): two processes on 127.0.0.1, each with one fake
CPU device, joined by jax.distributed into one TP=2 mesh, serve the tiny random Llama
(``tp_utils.TINY``; two layers compile in seconds, where a multi-process engine's programs are
never cached); its greedy outputs equal TP=1's (docs/architecture.md, "Testing numerics"), and
host 1 ends when host 0 does."""

import subprocess
import sys

import pytest
from server_utils import REPO, Server, free_port

from tests.integration import tp_utils

pytestmark = pytest.mark.slow


def test_two_hosts_serve_a_model_as_tp1(tp_offline, tp_prompts, tiny_tp_folders, tiny_hf_models,
                                        tmp_path):
    hosts = ["--model", str(tiny_tp_folders["llama"]), "--num-hosts", "2",
             "--distributed-coordinator", f"127.0.0.1:{free_port()}",
             "--tensor-parallel-size", "2", *tp_utils.TP_CLI_FLAGS]
    follower_log = tmp_path / "host1.log"
    with open(follower_log, "w") as log:
        follower = subprocess.Popen(
            [sys.executable, "-m", "jaxserve.serve", "--host-id", "1", *hosts], cwd=REPO,
            stdout=log, stderr=subprocess.STDOUT, env=tp_utils.fake_devices_env(1))
    try:
        server = Server("--host-id", "0", *hosts, env=tp_utils.fake_devices_env(1))
        try:
            choices = tp_utils.serve_greedy(server.url, tp_prompts)
            log0 = server.output()
        finally:
            assert server.stop() == 0
        assert follower.wait(60) == 0
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    log1 = follower_log.read_text()
    assert "host 0 of 2: serving" in log0 and "split over 2 devices" in log0
    assert "ready: host 1 of 2, following host 0" in log1 and "host 0 has ended" in log1
    ref = tp_offline["llama:1"]
    assert [c.prompt_token_ids for c in choices] == ref["prompt_ids"]
    tp_utils.assert_greedy_matches([c.token_ids for c in choices], ref["output_ids"],
                                   ref["prompt_ids"], tiny_hf_models["llama"],
                                   "two hosts at TP=2")


def test_a_mesh_that_leaves_out_a_host_is_refused():
    # TP=2 takes host 0's two devices only: host 1 would hold nothing. Both hosts say so.
    hosts = ["--num-hosts", "2", "--distributed-coordinator", f"127.0.0.1:{free_port()}",
             "--tensor-parallel-size", "2", "--port", "0", *tp_utils.TP_CLI_FLAGS]
    procs = [subprocess.Popen([sys.executable, "-m", "jaxserve.serve", "--host-id", str(i), *hosts],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=tp_utils.fake_devices_env(2 - i))
             for i in (0, 1)]
    for p in procs:
        out = p.communicate(timeout=300)[0]
        assert p.returncode == 2, out[-3000:]
        assert ("--tensor-parallel-size 2 takes the devices of 1 of the --num-hosts 2 hosts; "
                "raise it so that the mesh spans every host") in out
        assert "Traceback" not in out
