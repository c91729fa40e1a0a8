"""What the node agent offers: GPUs as nvidia-smi lists them, else CPU slots."""

import shutil

import pytest

from flightdeck.services.agent.inventory import DEFAULT_CPU_SLOTS, AgentError, Inventory, detect, parse_gpus

# What `nvidia-smi --query-gpu=name,memory.total --format=csv,noheader,nounits` printed on an H100 host.
H100 = "NVIDIA H100 80GB HBM3, 81559\n"


def test_gpus_are_read_by_name_and_memory() -> None:
    assert parse_gpus(H100) == [("NVIDIA H100 80GB HBM3", 79.6)]
    assert parse_gpus(H100 * 2 + "\n") == [("NVIDIA H100 80GB HBM3", 79.6)] * 2
    assert parse_gpus("Some, Odd GPU, [N/A]\n") == [("Some, Odd GPU, [N/A]", 0.0)]  # memory unknown, still a GPU
    assert parse_gpus("") == []


def test_cpu_slots_are_what_was_asked_for_or_the_default() -> None:
    inv = detect("cpu", 3)
    assert (inv.kind, inv.slots, inv.devices) == ("cpu", 3, ["cpu"] * 3) and inv.memory_gb > 0
    assert detect("cpu", None) == Inventory("cpu", DEFAULT_CPU_SLOTS, ["cpu"] * DEFAULT_CPU_SLOTS, inv.memory_gb)


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="needs a machine without nvidia-smi")
def test_asking_for_gpus_where_there_are_none_says_what_to_change() -> None:
    with pytest.raises(AgentError, match="--device cpu"):
        detect("cuda", None)
    assert detect("auto", None).kind == "cpu"
