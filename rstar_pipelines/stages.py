"""The stage kinds that pipeline.yaml may name, by class name."""

from __future__ import annotations

from rstar_pipelines.agent.eval_stages import GRPOEvaluation
from rstar_pipelines.coder.generation_stages import (
    CandidateSolutions,
    ProblemSynthesis,
    TestInputGeneration,
)
from rstar_pipelines.coder.verification_stages import MutualVerification, VerifiedSolutions
from rstar_pipelines.dser.comparison import EvaluationComparison
from rstar_pipelines.dser.stages import DSEREvaluation
from rstar_pipelines.math.eval_stages import MCTSEvaluation
from rstar_pipelines.math.search_stages import MCTSTrajectories, PreferencePairs, SFTDataset
from rstar_pipelines.pipeline.stage import Stage
from rstar_pipelines.problems import ProblemGrouping
from rstar_pipelines.seeds.stages import SeedCatalog, SeedIngestion
from rstar_pipelines.training.agent_stages import GRPORoCCheckpoint, GRPORoCData
from rstar_pipelines.training.gate_stages import (
    AttnGateCheckpoint,
    AttnGateEvaluation,
    GateDistillData,
)
from rstar_pipelines.training.stages import PolicyCheckpoint, PPMCheckpoint

STAGES: dict[str, type[Stage]] = {
    cls.__name__: cls
    for cls in (
        SeedIngestion,
        SeedCatalog,
        ProblemSynthesis,
        ProblemGrouping,
        TestInputGeneration,
        CandidateSolutions,
        MutualVerification,
        VerifiedSolutions,
        MCTSTrajectories,
        PreferencePairs,
        SFTDataset,
        PolicyCheckpoint,
        PPMCheckpoint,
        GRPORoCData,
        GRPORoCCheckpoint,
        MCTSEvaluation,
        GRPOEvaluation,
        DSEREvaluation,
        EvaluationComparison,
        GateDistillData,
        AttnGateCheckpoint,
        AttnGateEvaluation,
    )
}
