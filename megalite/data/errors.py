"""The data error, and the messages shared by the readers and the samplers."""


class DataError(ValueError):
    """Missing, truncated or mismatched data; the message names the file or key and the fix."""


def too_few_train_samples(global_batch_size: int, num_samples: int) -> str:
    return (f"train.global_batch_size={global_batch_size}: the training split has only "
            f"{num_samples} samples of this train.seq_len; lower the batch or train.seq_len, or "
            "prepare more data")
