"""Built-in environments for ``rl.environment`` (``syncwise.environments:GuessNumber``), written to TRL's
``environment_factory`` contract as a user's would be: one instance per conversation, ``reset(**row)``, public
methods the tools, ``get_reward()``; and syncwise's ``metrics`` property (a name TRL never takes for a tool) and
Python's ``__getstate__`` / ``__setstate__`` (a checkpoint of partial rollouts keeps its games in flight).

``GuessNumber`` is a task whose episodes need several calls and state: find a hidden number from
higher / lower answers (``syncwise sft --write-example-data DIR --task guess_number`` writes the SFT chats and
the GRPO prompts). Each answer says the range that is left, so a policy that halves it every time (binary
search) needs at most ceil(log2(size + 1)) guesses, one that guesses anywhere in it about twice as many.
"""

from __future__ import annotations

from typing import Any

GUESS_PENALTY = 0.1  # taken off a solved episode's reward for every guess after the first


class GuessNumber:
    """Find the hidden number between ``low`` and ``high`` (a row's columns) by calling ``guess``."""

    def reset(self, low: int, high: int, secret: int, **row: Any) -> None:
        self.low, self.high, self.secret = int(low), int(high), int(secret)
        self.guesses, self.solved = 0, False

    def guess(self, number: int) -> str:
        """Guess the hidden number.

        Args:
            number: The number you guess.
        """
        if self.solved:
            return "already found"
        self.guesses += 1
        number = int(number)
        if number == self.secret:
            self.solved = True
            return "correct"
        if number < self.secret:
            self.low = max(self.low, number + 1)
            return f"higher: {self.low} to {self.high}"
        self.high = min(self.high, number - 1)
        return f"lower: {self.low} to {self.high}"

    def get_reward(self) -> float:
        """1 for a found number, less 0.1 for each guess after the first (never below 0.1); 0 otherwise."""
        if not self.solved:
            return 0.0
        return max(1.0 - GUESS_PENALTY * (self.guesses - 1), 0.1)

    @property
    def metrics(self) -> dict[str, float]:
        return {"solved": float(self.solved), "guesses": float(self.guesses)}

    def __getstate__(self) -> dict[str, Any]:
        """The episode as plain data: a partial rollout's checkpoint keeps a game in flight."""
        return dict(vars(self))

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
