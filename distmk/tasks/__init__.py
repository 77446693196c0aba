"""The registry of task types: a type's id is its index here, and the task table stores that id.

Adding a task type means one new file in this package and one line below."""
from distmk.tasks.allreduce import AllReduce
from distmk.tasks.argmax import Argmax
from distmk.tasks.argmax_push import ArgmaxPush
from distmk.tasks.attention import Attention
from distmk.tasks.attn_reduce import AttnReduce
from distmk.tasks.base import TaskKind
from distmk.tasks.down import Down
from distmk.tasks.embed import Embed
from distmk.tasks.expert_down import ExpertDown
from distmk.tasks.expert_gate_up import ExpertGateUp
from distmk.tasks.gate_up import GateUp
from distmk.tasks.lm_head import LMHead
from distmk.tasks.moe_combine import MoeCombine
from distmk.tasks.o_proj import OProj
from distmk.tasks.qkv import QKV
from distmk.tasks.route import Route
from distmk.tasks.router import Router

TASK_KINDS: list[TaskKind] = [Embed(), QKV(), Attention(), AttnReduce(), OProj(), AllReduce(), GateUp(), Down(),
                              LMHead(), ArgmaxPush(), Argmax(), Router(), Route(), ExpertGateUp(), ExpertDown(),
                              MoeCombine()]
TYPE_ID = {kind.name: i for i, kind in enumerate(TASK_KINDS)}


def register(kind: TaskKind) -> int:
    """Add a task type after the built-in ones (a plugin's, a test's); returns its id. The megakernels generated
    afterwards dispatch to its device functions by their parameters' names."""
    if kind.name in TYPE_ID:
        raise ValueError(f"a task type named {kind.name!r} is registered already")
    TASK_KINDS.append(kind)
    TYPE_ID[kind.name] = len(TASK_KINDS) - 1
    return TYPE_ID[kind.name]
