"""Which lookup layers keep their table on this process (the ps trainer warns about them)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit


def test_tables_outside_a_ps_scope_are_named_nested_ones_too(capsys: pytest.CaptureFixture[str]) -> None:
    import keras

    from keras_distrib.logs import configure_script
    from keras_distrib.trainers.lookups import tables_on_this_process, warn_tables_on_the_chief

    text = keras.layers.TextVectorization(max_tokens=10, name="vectorize")
    text.adapt(["a b", "c d"])
    raw = keras.Input((1,), dtype="string")
    ints = keras.Input((1,), dtype="int64")
    h = keras.layers.Concatenate()([
        keras.layers.StringLookup(vocabulary=["a", "b"], name="words")(raw),
        keras.layers.IntegerLookup(vocabulary=[3, 5], name="ids")(ints),
        keras.layers.Hashing(num_bins=4, name="hash")(raw),
    ])
    model = keras.Model([raw, ints], h)
    assert tables_on_this_process(model) == ["words", "ids"]
    sequential = keras.Sequential([keras.Input((), dtype="string"), text])
    assert tables_on_this_process(sequential) == [text._lookup_layer.name]
    configure_script()  # what fit does inside SCRIPT: "keras_distrib: warning: ..." on stderr
    capsys.readouterr()
    warn_tables_on_the_chief(model)
    err = capsys.readouterr().err
    assert err.startswith("keras_distrib: warning: the lookup tables of layers words, ids were") and err.count("\n") == 1, err
    assert "the lookup tables of layers words, ids were created outside strategy.scope()" in err and "HINT: " in err
    warn_tables_on_the_chief(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))
    assert capsys.readouterr().err == ""
