"""Pipeline parallelism on torch's own engine: stages on sub-meshes, torch's schedules, data-parallel
copies of each stage, and the encoder in the LLM's bubbles.

``stages.py``: ``stage_meshes``/``lanes`` (which ranks run which stage), ``pipeline_stage`` (a
converted chunk as torch's ``PipelineStage``), ``SCHEDULES``; ``agreement.py``: every step agreed
over the pipeline before it sends anything; ``data_parallel.py``: copies of each stage;
``layouts.py``: stages of different mesh shapes; ``rank_sets.py``: stages on rank sets of different
sizes (an encoder on its own ranks); ``placement.py``: whether an encoder runs beside the model
on every rank or apart on ranks of its own, and on which meshes, by cost; ``bubbles.py``: a frozen
encoder scheduled into the LLM's idle slots (torch's action-list runtime); ``partition.py``: layers to stages by cost;
``simulator.py``: timelines from measured costs; ``models/``: LLaMA, GPT-2 and LLaVA cut into stages.
Gradient clipping over every stage is ``optimus2d.clip_grad_norm_(params, max_norm, pipe)``.
"""

from optimus2d import training
from optimus2d._deprecated import moved_attribute
from optimus2d.pipeline.layouts import ToNextStage, gather_microbatches, scatter_microbatches
from optimus2d.pipeline.placement import Placement, propose_placement
from optimus2d.pipeline.rank_sets import RankSets, rank_sets
from optimus2d.pipeline.stages import SCHEDULES, StageMesh, lanes, mesh_sum, pipeline_stage, stage_meshes

__all__ = [
    "SCHEDULES",
    "Placement",
    "RankSets",
    "StageMesh",
    "ToNextStage",
    "gather_microbatches",
    "lanes",
    "mesh_sum",
    "pipeline_stage",
    "propose_placement",
    "rank_sets",
    "scatter_microbatches",
    "stage_meshes",
]


def __getattr__(name: str):  # optimus2d.pipeline.clip_grad_norm_: now optimus2d.clip_grad_norm_ (pipe=)
    return moved_attribute(__name__, name, training, ("clip_grad_norm_",))
