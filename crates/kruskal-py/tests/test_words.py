"""Python speaks Python: every message a Python user sees names keywords
(not command-line options), counts modes and positions from 0, uses
Python's ranges, and is one of the documented exceptions or a
UserWarning."""

import re
import warnings

import numpy as np
import pytest

import kruskal

from conftest import DATA, REPO


def tensor(shape=(6, 5, 4), nnz=30, seed=0, values=None):
    rng = np.random.default_rng(seed)
    flat = rng.choice(int(np.prod(shape)), nnz, replace=False)
    subs = np.stack(np.unravel_index(np.sort(flat), shape), axis=1).astype(np.int64)
    vals = rng.integers(1, 41, size=nnz) / 4 if values is None else np.full(nnz, values)
    return kruskal.SparseTensor(subs, vals, shape)


def no_command_line(text):
    """No `--option`, no Rust range (`0..2`) in `text`."""
    assert not re.search(r"--[a-z]", text), text
    assert not re.search(r"\d\.\.=?\d", text), text


def test_a_pattern_files_warning_names_the_keyword_and_the_file_once():
    path = DATA / "kg-jf17k-4mode-novalues.tns.gz"
    with pytest.warns(UserWarning) as caught:
        kruskal.read(path)
    text = str(caught[0].message)
    assert "pattern=True" in text, text
    assert text.count(path.name) == 1, text
    no_command_line(text)


def test_a_file_of_0_based_indices_names_the_keyword(tmp_path):
    path = tmp_path / "zero.tns"
    path.write_text("1 1 1.0\n0 2 2.0\n")
    with pytest.raises(ValueError) as e:
        kruskal.read(path)
    text = str(e.value)
    assert "zero.tns:2: index 0 in column 1" in text, text
    assert text.endswith("use zero_based=True for files whose indices start at 0"), text
    no_command_line(text)
    X = kruskal.read(path, zero_based=True)
    assert X.shape == (2, 3), X.shape


def test_a_gpu_kernel_on_the_cpu_names_the_keyword():
    X = tensor()
    with pytest.raises(ValueError) as e:
        kruskal.cp_als(X, 2, kernel="coo", backend="cpu", progress=False)
    assert 'kernel="coo"' in str(e.value), e.value
    no_command_line(str(e.value))
    with pytest.raises(ValueError) as e:
        kruskal.mttkrp(X, [np.ones((d, 2)) for d in X.shape], 0, kernel="coo", backend="cpu")
    assert 'kernel="coo"' in str(e.value), e.value
    no_command_line(str(e.value))


def test_notes_are_topic_and_text_not_the_command_lines_columns():
    m = kruskal.cp_als(tensor(), 2, iters=2, progress=False)
    assert m.info["notes"], m.info
    for note in m.info["notes"]:
        topic, text = note
        # Data, not the command line's padded `topic      text`.
        assert topic and topic == topic.strip(), note
        assert text == text.strip(), note
        no_command_line(text)
    assert any(topic == "backend" and text.startswith("cpu")
               for topic, text in m.info["notes"]), m.info["notes"]


def test_modes_and_positions_count_from_zero():
    X = tensor()
    # The third factor (index 2) has the wrong rows.
    bad = [np.ones((6, 2)), np.ones((5, 2)), np.ones((3, 2))]
    with pytest.raises(ValueError, match=r"init\[2\] is 3 x 2, expected 4 x 2 \(shape\[2\] is 4\)"):
        kruskal.cp_als(X, 2, init=bad, progress=False)
    with pytest.raises(ValueError, match=r"factors\[2\] is 3 x 2"):
        kruskal.mttkrp(X, bad, 0)
    with pytest.raises(ValueError, match=r"mode=3 is out of range .* at most 2"):
        kruskal.mttkrp(X, [np.ones((d, 2)) for d in X.shape], 3)
    with pytest.raises(ValueError, match=r"init\[1\] is all zeros"):
        kruskal.cp_als(X, 2, init=[np.ones((6, 2)), np.zeros((5, 2)), np.ones((4, 2))],
                       progress=False)
    with pytest.raises(ValueError) as e:
        kruskal.SparseTensor(np.array([[0, 5, 0]]), [1.0], (2, 5, 3))
    assert str(e.value).startswith("indices[0, 1] is 5, outside range(5)"), e.value
    no_command_line(str(e.value))


def test_a_file_read_with_fewer_rows_than_the_factors_names_dims():
    # Three nonzeros of a (10, 8, 6) tensor: a text file's dimensions are
    # its largest indices, so the file reads as a smaller tensor.
    X = kruskal.SparseTensor(np.array([[0, 0, 0], [2, 1, 3], [4, 3, 1]]), [1.0, 2.0, 3.0],
                             (5, 4, 4))
    init = [np.ones((d, 2)) for d in (10, 8, 6)]
    with pytest.raises(ValueError, match=r"kruskal.read\(path, dims=\(10, 8, 6\)\)"):
        kruskal.cp_als(X, 2, init=init, progress=False)


def test_values_beyond_float32_say_so():
    with pytest.raises(ValueError, match="float32") as e:
        kruskal.SparseTensor(np.array([[0, 0], [1, 1]]), [1.0, 1e40], (2, 2))
    assert "values[1]" in str(e.value), e.value
    with pytest.raises(ValueError, match=r"values\[0\] is nan: values must be finite"):
        kruskal.SparseTensor(np.array([[0, 0]]), [np.nan], (2, 2))


def test_the_wrong_kind_of_object_is_a_type_error():
    for method, what in [("from_pyttb", "pyttb.sptensor"), ("from_sparse", "sparse.COO"),
                         ("from_scipy", "scipy.sparse")]:
        with pytest.raises(TypeError, match=re.escape(what)) as e:
            getattr(kruskal.SparseTensor, method)(np.ones((3, 3)))
        assert "ndarray" in str(e.value), e.value
    with pytest.raises(TypeError, match="not ndarray"):
        kruskal.cp_als(np.ones((3, 3)), 2)


def test_the_command_lines_warnings_are_python_warnings():
    cases = [
        (dict(rank=7), tensor(), r"rank 7 is larger than mode 2's dimension 4"),
        (dict(rank=2, iters=0), tensor(), r"iters=0: no iteration runs"),
        (dict(rank=2, iters=2), tensor(values=0.0), r"the tensor is all zeros"),
    ]
    for kwargs, X, match in cases:
        with pytest.warns(UserWarning, match=match) as caught:
            kruskal.cp_als(X, progress=False, **kwargs)
        for w in caught:
            no_command_line(str(w.message))
    # An ordinary run warns of nothing.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kruskal.cp_als(tensor(), 2, iters=2, progress=False)


def test_no_progress_bar_before_an_argument_error(capfd):
    X = tensor()
    with pytest.raises(ValueError):
        kruskal.cp_als(X, 2, kernel="bogus", progress=True)
    with pytest.raises(ValueError):
        kruskal.cp_als(X, 2, init=[np.ones((6, 2))], progress=True)
    err = capfd.readouterr().err
    assert "iteration" not in err and "fit" not in err, err


def test_every_exception_raised_is_in_the_documented_table():
    doc = (REPO / "docs" / "python.md").read_text()
    table = doc.split("### Errors", 1)[1].split("\n\n", 2)[1]
    documented = set(re.findall(r"^\| `([\w.]+)`", table, flags=re.M))
    X = tensor()
    calls = [
        lambda: kruskal.cp_als(X, 0, progress=False),
        lambda: kruskal.cp_als(X, 2, kernel="coo", backend="cpu", progress=False),
        lambda: kruskal.cp_als(np.ones(3), 2),
        lambda: kruskal.SparseTensor.from_pyttb(np.ones(3)),
        lambda: kruskal.SparseTensor(np.array([[0, 9]]), [1.0], (2, 2)),
        lambda: kruskal.read(REPO / "no-such-file.tns"),
        lambda: kruskal.mttkrp(X, [np.ones((d, 2)) for d in X.shape], -1),
    ]
    for call in calls:
        with pytest.raises(Exception) as e:
            call()
        kind = type(e.value)
        names = {k.__name__ for k in kind.__mro__} | {f"kruskal.{kind.__name__}"}
        assert names & documented, (kind, documented)
        no_command_line(str(e.value))
