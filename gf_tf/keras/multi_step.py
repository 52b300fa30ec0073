"""Keras's step loop, rebuilt so a call that runs out of data counts no step that had no batch.

Keras's TensorFlow trainer reads a step's batch with `next(iterator)` where the data may be over:
every step of Keras 3.6's `steps_per_execution` loop (a Python loop of one-step calls in one
tf.function, `make_train_function`), and the one step of Keras 3.7-3.15's `_make_function` at
`steps_per_execution=1`. Reading past the data raises OutOfRangeError, which ends the epoch, but
the step's stateful ops that do not wait for the batch have run by then: the optimizer's iteration
counter and GradientFlow's step counters (CSC warm-up and schedule) count a step that trained on
nothing, so learning-rate schedules and CSC shift. That happens in the last call of an epoch whose
length is unknown (Keras finds the end by reading past it), and with Keras 3.6 also where the
number of batches is not a multiple of `steps_per_execution` (with TF's own all-reduce too: two
epochs of 7 batches count 16 steps, not 14). Keras 3.7 on stop at the data's end themselves for
`steps_per_execution > 1` (a while loop on `get_next_as_optional`). tf-keras's one step does the
same in the first epoch of data of unknown length (it learns the length there).

`guarded_function` is the loop with every step taken only when the iterator still has a batch
(`get_next_as_optional`; a `tf.cond` in cross-replica context around `strategy.run` of the step,
inlined as gf_tf inlines Keras 3.7's loop). A call that finds no batch raises StopIteration, which
ends the epoch as Keras's own function does (Keras 3.6 and tf-keras catch it as they catch
OutOfRangeError). `guarded_tf_keras_train_function` is tf-keras's one step, guarded alike.
"""

import tensorflow as tf


def guarded_function(model, step_function, fallback=None):
    """A function(iterator) -> logs (Keras's reduced step outputs, a dict of scalar tensors for
    train and test steps) running up to `model.steps_per_execution` steps of `step_function`
    (`model.train_step` or `test_step`; `model` a Keras 3 TensorFlowTrainer) in one tf.function
    call, none without a batch. Raises StopIteration if the iterator had none. `fallback`
    serves iterators other than TF's (Keras 3.7 on also take a Python iterator of batches)."""
    from keras.src.backend.tensorflow import trainer as tf_trainer  # pylint: disable=import-outside-toplevel
    strategy = model.distribute_strategy

    def one_step(data):
        outputs = strategy.run(step_function, args=(data,))
        return tf_trainer.reduce_per_replica(outputs, strategy, reduction="auto")
    return _guarded(one_step, model.steps_per_execution, fallback)


def guarded_tf_keras_train_function(model):
    """tf-keras's one-step train function (`Model.make_train_function` at steps_per_execution=1:
    `train_step`, then `_train_counter` + 1, logs reduced by `distribute_reduction_method`), with
    the step taken only when the iterator still has a batch. tf-keras reads past the data's end
    in the first epoch of data of unknown length (14 batches in 2 epochs of 7 counted 15 steps).
    Its multi-step loop needs no guard: tf-keras refuses data of unknown length there and shortens
    an epoch's last call to the batches left. Raises StopIteration if the iterator had none."""
    from tf_keras.src.engine import training  # pylint: disable=import-outside-toplevel
    strategy = model.distribute_strategy

    def run_step(data):
        outputs = model.train_step(data)
        with tf.control_dependencies(training._minimum_control_deps(outputs)):  # pylint: disable=protected-access
            model._train_counter.assign_add(1)  # pylint: disable=protected-access
        return outputs

    def one_step(data):
        outputs = strategy.run(run_step, args=(data,))
        return training.reduce_per_replica(outputs, strategy,
                                           reduction=model.distribute_reduction_method)
    return _guarded(one_step, 1)


def _guarded(one_step, steps, fallback=None):
    """function(iterator) -> logs: up to `steps` calls of one_step(batch) -> logs in one
    tf.function call, each in a `tf.cond` on the iterator's next optional batch. The function's
    `tf_function` is that tf.function (tf-keras's TensorBoard callback draws its graph)."""
    traced = {}   # the logs' structure, from the first branch traced (cond traces its true branch first)

    def step_on(optional):
        traced["logs"] = one_step(optional.get_value())
        return traced["logs"]

    def steps_on_iterator(iterator):
        optional = iterator.get_next_as_optional()
        ran = optional.has_value()
        outputs = tf.cond(ran, lambda: step_on(optional),
                          lambda: tf.nest.map_structure(tf.zeros_like, traced["logs"]))
        for _ in range(steps - 1):
            optional = iterator.get_next_as_optional()
            outputs = tf.cond(optional.has_value(), lambda optional=optional: step_on(optional),
                              lambda outputs=outputs: outputs)
        return ran, outputs

    compiled = tf.function(steps_on_iterator, reduce_retracing=True, autograph=False)

    def function(iterator):
        if fallback is not None and not isinstance(
                iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            return fallback(iterator)
        ran, outputs = compiled(iterator)
        if not ran:
            raise StopIteration
        return outputs
    function.tf_function = compiled
    return function
