"""Early stopping on a validation split: importing this module registers `fashion_mnist_val`,
Fashion-MNIST with its last VALIDATION training examples held out of training, and a hook that
evaluates them after each evaluation (`val_loss`, `val_accuracy` in the row) and ends the run
once `config.patience` evaluations in a row have not beaten the best `val_accuracy`."""

from fmnist_flax import datasets, evaluate, train

VALIDATION = 5_000  # training examples held out, the last ones of the file
held_out = {}  # the validation split's images and labels, once the dataset is loaded
best = {"accuracy": -1.0, "waited": 0}


@datasets.register("fashion_mnist_val")
def fashion_mnist_less_validation(data_dir, config):
    """Fashion-MNIST, training on all but its last VALIDATION training examples."""
    full = datasets.load_dataset("fashion_mnist", data_dir)
    x, y = full.train_images, full.train_labels
    held_out.update(images=x[-VALIDATION:], labels=y[-VALIDATION:])
    return datasets.make_dataset(
        "fashion_mnist_val",
        f"{full.title} less {VALIDATION:,} for validation",
        full.class_names,
        (x[:-VALIDATION], y[:-VALIDATION]),
        (full.test_images, full.test_labels),
        sources=full.sources,
        origin=full.origin,
        checked=full.checked,
    )


@train.after_evaluation
def validate(step, metrics, run):
    """Add the validation split's loss and accuracy to the row; True (stop) once
    config.patience evaluations in a row have not beaten the best validation accuracy."""
    run.model.eval()  # dropout off, BatchNorm on its averages: as the test set is evaluated
    found = evaluate.evaluate(
        run.model, held_out["images"], held_out["labels"], run.config, run.device_data.mesh
    )
    run.model.train()
    metrics.update(val_loss=found["loss"], val_accuracy=found["accuracy"])
    if found["accuracy"] > best["accuracy"]:
        best.update(accuracy=found["accuracy"], waited=0)
    else:
        best["waited"] += 1
    return best["waited"] >= run.config.patience
