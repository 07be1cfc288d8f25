"""What a tracker holds, read back with its own reader."""


def scalars_in(tb_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard's own reader finds under tb_dir: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    reader = EventMultiplexer().AddRunsFromDirectory(str(tb_dir))
    reader.Reload()
    found: dict[str, list[tuple[int, float]]] = {}
    for run in reader.Runs():
        for tag in reader.GetAccumulator(run).Tags()["scalars"]:
            found.setdefault(tag, []).extend((e.step, e.value) for e in reader.GetAccumulator(run).Scalars(tag))
    return found
