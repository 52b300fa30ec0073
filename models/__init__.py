"""Reference Keras models, datasets and the `python -m models.train` script.

Runs from a checkout (not installed as a top-level package): the name
`models` is too generic to claim in site-packages.
"""
