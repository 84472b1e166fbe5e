"""FedRolex (HeteroFL with rolling sub-models): determinism, the Scaler only with normalisation layers,
batched sub-models equal to sequential."""
from support import (
    check_batched_sub_models_equal_sequential,
    check_same_seed_identical_metrics,
    check_scaler_auto_only_with_normalisation_layers,
)


def test_same_seed_identical_metrics():
    check_same_seed_identical_metrics("fedrolex")


def test_scaler_auto_only_with_normalisation_layers():
    check_scaler_auto_only_with_normalisation_layers("fedrolex")


def test_batched_sub_models_with_scaler_and_masked_logits_equal_sequential():
    check_batched_sub_models_equal_sequential("fedrolex")
