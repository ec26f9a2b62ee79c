"""Weights over a gloo process group with the authenticated stream as control plane
(rollout.weight_transport 'collective', generation/weight_group.py): exact delivery in buckets,
refusal of a bucket that is not what the trainer announced, an outsider on gloo's sockets."""

from __future__ import annotations

import hashlib
import os
import socket
import threading

import pytest
import torch

from slurm_align.generation.weight_group import (
    META,
    GroupReceiver,
    GroupSender,
    StreamStore,
    WeightTamperError,
    open_group,
)
from slurm_align.generation.weight_stream import WeightAssembler
from tests.integration.test_disaggregated import _pair

SECRET = "s" * 32
HOST = "127.0.0.2"
"""The members' service address: a loopback address that neither this node's hostname nor an
unbound (every interface) socket gives, so a group that ignores the address it is given shows."""
HOST_HEX = socket.inet_aton(HOST)[::-1].hex().upper()   # as /proc/net/tcp writes it: "0200007F"


def listening(pid: str = "self") -> dict[int, str]:
    """This process's listening TCP sockets: port -> local address (hex, as /proc/net/tcp has it)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:   # 0A: LISTEN
                    addr, port = cols[1].rsplit(":", 1)
                    out[int(port, 16)] = addr
    return out


@pytest.fixture
def groups():
    """The trainer's and the generator's ends, on two authenticated streams' ends in one process."""
    server, got, t, dial = _pair(SECRET, SECRET)
    trainer_stream = dial()
    t.join(5)
    gen_stream = got["s"]
    server.close()
    before = set(listening())
    made = {}
    th = threading.Thread(target=lambda: made.setdefault("gen", open_group(gen_stream, 1, HOST, 30)))
    th.start()
    trainer = open_group(trainer_stream, 0, HOST, 30)
    th.join(30)
    gloo_ports = {p: a for p, a in listening().items() if p not in before}
    yield trainer_stream, trainer, gen_stream, made["gen"], gloo_ports
    trainer_stream.close()
    gen_stream.close()


def state_dict(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"decoder.layers.0.self_attention.linear_qkv.weight": torch.randn(40, 30, generator=g),
            "decoder.layers.0.input_layernorm.weight": torch.randn(30, generator=g).to(torch.bfloat16),
            "decoder.layers.1.mlp.linear_fc1.weight": torch.randn(300, generator=g),
            "decoder.layers.1.flag": torch.tensor([True, False, True]),   # 3 bytes: the next tensor is misaligned
            "decoder.layers.1.mlp.linear_fc2.weight": torch.randn(7, 5, generator=g),
            "output_layer.weight": torch.randn(16, 30, generator=g)}


def receive_version(gen_stream, receiver: GroupReceiver) -> tuple[int, dict[str, torch.Tensor]]:
    asm, done = WeightAssembler(), None
    while done is None:
        msg = gen_stream.recv(timeout=10)
        assert msg.kind == META and not msg.tensors   # the stream carries the announcement, no weights
        done = asm.feed(receiver.receive(msg))
    return done


def test_weights_arrive_exactly_in_buckets_over_the_group(groups):
    trainer_stream, trainer, gen_stream, gen, _ = groups
    sender, receiver = GroupSender(trainer_stream, trainer), GroupReceiver(gen)
    for version in (0, 1):
        sd = state_dict(version)
        nbytes = sender.send(sd, version, bucket_bytes=2000)   # posted, not waited for
        assert nbytes == sum(t.numel() * t.element_size() for t in sd.values())
        got_version, got = receive_version(gen_stream, receiver)
        assert got_version == version and sorted(got) == sorted(sd)
        for k, t in sd.items():
            assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
    sender.close(10)
    assert sender.pending == []


def test_a_bucket_that_is_not_what_the_trainer_announced_is_refused(groups):
    trainer_stream, trainer, gen_stream, gen, _ = groups
    announced, delivered = torch.zeros(64, dtype=torch.uint8), torch.ones(64, dtype=torch.uint8)
    real = GroupSender(trainer_stream, trainer)
    # the announcement of one payload, another one on the group (what a forged pair connection would carry)
    real.stream.send(META, {"version": 0, "bucket": 0, "buckets": 1, "names": ["w"], "shapes": [[16]],
                            "dtypes": ["torch.float32"],
                            "sha256": hashlib.sha256(announced.numpy().tobytes()).hexdigest()})
    trainer.broadcast(delivered, 0)
    with pytest.raises(WeightTamperError, match="differs from what the trainer announced"):
        GroupReceiver(gen).receive(gen_stream.recv(timeout=10))


def test_an_outsider_on_the_gloo_sockets_changes_nothing(groups):
    """Someone else on the node connects to every socket the group listens on and sends junk;
    the next version still arrives exactly, and the sockets bind the members' address only."""
    trainer_stream, trainer, gen_stream, gen, gloo_ports = groups
    assert gloo_ports, "the group opened no listening socket to attack"
    assert set(gloo_ports.values()) == {HOST_HEX}, gloo_ports   # never every interface, nor the hostname's
    for port in gloo_ports:
        with socket.create_connection((HOST, port), timeout=5) as s:
            s.sendall(os.urandom(4096))
    sender = GroupSender(trainer_stream, trainer)
    sd = state_dict(7)
    sender.send(sd, 5, bucket_bytes=1 << 20)
    version, got = receive_version(gen_stream, GroupReceiver(gen))
    assert version == 5 and all(torch.equal(got[k], sd[k]) for k in sd)
    sender.close(10)


def test_the_rendezvous_takes_only_store_messages_from_the_stream():
    server, got, t, dial = _pair(SECRET, SECRET)
    client = dial()
    t.join(5)
    client.send("samples", {"step": 1})
    with pytest.raises(RuntimeError, match="sent 'samples', expected 'store'"):
        StreamStore(got["s"], 5).get("0/0")
    with pytest.raises(NotImplementedError, match="two-member"):
        StreamStore(got["s"], 5).add("k", 1)
    client.close()
    server.close()
