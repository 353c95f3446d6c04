"""What a run optimizes: objectives (DLRM, meta), the dense head, the dense optimizer,
the matmul precision and one's own model."""

__all__ = ["dense_head", "objectives", "optim", "precision", "user_model"]
