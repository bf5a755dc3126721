"""The built-in answer checkers (syncwise.rewards) on awkward strings: commas, signs, decimals, several
answers, none."""

from __future__ import annotations

import pytest

from syncwise.rewards import boxed, final_number


@pytest.mark.parametrize(("response", "answer", "reward"), [
    ("3 + 4 = 7.\n#### 7", "7", 1.0),
    ("#### 1,234", "1234", 1.0),
    ("so the total is 1,234.", "1234", 1.0),  # no ####: the last number
    ("#### +5", "5", 1.0),
    ("#### -5", "5", 0.0),
    ("#### 5.0", "5", 1.0),
    ("#### 5.50", "5.5", 1.0),
    ("#### 7 apples", "7", 1.0),
    ("first 3, then #### 4 and later #### 9", "9", 1.0),  # the last ####
    ("#### 12 #### ", "12", 0.0),  # the last #### has no number
    ("#### 19 apples in 2 baskets", "19", 1.0),  # the number right after ####, not the last (issue 38)
    ("#### 19 (after 2 steps)", "19", 1.0),
    ("#### 19, then 20", "19", 1.0),
    ("#### 2 baskets of 19", "19", 0.0),  # verl / lm-eval read 2
    ("no number here", "3", 0.0),
    ("", "3", 0.0),
    ("#### .5", "0.5", 1.0),
    ("#### 10", "1", 0.0),
])
def test_final_number(response, answer, reward):
    assert final_number("", response, {"answer": answer}) == reward


@pytest.mark.parametrize(("response", "answer", "reward"), [
    ("so \\boxed{42}", "42", 1.0),
    ("\\boxed{1} then \\boxed{2}", "2", 1.0),  # the last box
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),  # nested braces kept whole
    ("\\boxed{ \\text{yes} }", "yes", 1.0),
    ("\\boxed{$-3$}", "-3", 1.0),
    ("\\boxed{3", "3", 0.0),  # unbalanced
    ("the answer is 42", "42", 0.0),  # no box
])
def test_boxed(response, answer, reward):
    assert boxed("", response, {"answer": answer}) == reward


def test_a_row_without_an_answer_is_named():
    with pytest.raises(KeyError, match="'answer' column"):
        final_number("", "#### 3", {"prompt": "x"})
