"""Environments of the multi-turn tests: a researcher's own (a file of their own, for a chat model), one that
records its initial states, and each way an environment can break the contract."""

import random
import threading
import time

import toy


class SaysAnswer:
    """A researcher's environment for the own-inputs chat model: the row's prompt first; reward 1 each turn whose
    answer holds "answer" (the model's SFT format: about half its samples), the episode done after two turns."""

    def reset(self, row: dict, seed: int) -> str:
        self.turn = 0
        return row["prompt"]

    def step(self, action: str) -> tuple[str | None, float, bool]:
        self.turn += 1
        reward = float("answer" in action)
        return (None, reward, True) if self.turn == 2 else ("what is one plus two ?", reward, False)


class RecordsResets(toy.GuessTheNumber):
    """Guess-the-number that records each reset's (secret, seed), in order."""

    resets = []

    def reset(self, row: dict, seed: int) -> str:
        RecordsResets.resets.append((row["secret"], seed))
        return super().reset(row, seed)


class RaisesInReset(toy.GuessTheNumber):
    def reset(self, row, seed):
        raise ValueError("no such level")


class RaisesInStep(toy.GuessTheNumber):
    def step(self, action):
        raise RuntimeError("the tool crashed")


class HangsInStep(toy.GuessTheNumber):
    def step(self, action):
        time.sleep(3600)


class HangsLater(toy.GuessTheNumber):
    """Guess-the-number whose episodes from the 17th reset of the process on hang at their first step: in the third
    update of a run of 8 episodes an update, with no evaluation."""

    resets = 0

    def reset(self, row: dict, seed: int) -> str:
        HangsLater.resets += 1
        self.hangs = HangsLater.resets > 16
        return super().reset(row, seed)

    def step(self, action):
        if self.hangs:
            time.sleep(3600)
        return super().step(action)


class ResetReturnsNumber(toy.GuessTheNumber):
    def reset(self, row, seed):
        super().reset(row, seed)
        return 7


class StepReturnsText(toy.GuessTheNumber):
    def step(self, action):
        return "higher"


class RewardIsText(toy.GuessTheNumber):
    def step(self, action):
        return "higher :", "1", False


class RewardIsNan(toy.GuessTheNumber):
    def step(self, action):
        return "higher :", float("nan"), False


class DoneIsText(toy.GuessTheNumber):
    def step(self, action):
        return "higher :", 0.0, "no"


class NoMessageNotDone(toy.GuessTheNumber):
    def step(self, action):
        return None, 0.0, False


class NeedsArguments(toy.GuessTheNumber):
    def __init__(self, size):
        self.size = size


class NoStep:
    def reset(self, row, seed):
        return "hello"


class CountsConcurrentSteps(toy.GuessTheNumber):
    """Guess-the-number whose steps take 0.2 s each, counting how many run at once (the most, in `most`)."""

    running = most = 0
    lock = threading.Lock()

    def step(self, action):
        with CountsConcurrentSteps.lock:
            CountsConcurrentSteps.running += 1
            CountsConcurrentSteps.most = max(CountsConcurrentSteps.most, CountsConcurrentSteps.running)
        time.sleep(0.2)
        with CountsConcurrentSteps.lock:
            CountsConcurrentSteps.running -= 1
        return super().step(action)


class SecretFromSeed(toy.GuessTheNumber):
    """Guess-the-number whose secret comes from the reset seed, not the row: episodes differ where seeds do."""

    def reset(self, row: dict, seed: int) -> str:
        return super().reset({"secret": random.Random(seed).randint(1, toy.GUESS_RANGE)}, seed)


class SecretFromSeedNarrowing(SecretFromSeed):
    """SecretFromSeed whose state_key() is the range the answers so far leave (--turn_advantage gigpo's anchor
    states): a group's episodes share their secret, so their turns meet in the same ranges."""

    def reset(self, row: dict, seed: int) -> str:
        self.low, self.high = 1, toy.GUESS_RANGE
        return super().reset(row, seed)

    def state_key(self) -> tuple[int, int]:
        return self.low, self.high

    def step(self, action: str) -> tuple[str | None, float, bool]:
        message, reward, done = super().step(action)
        if message in ("higher :", "lower :"):
            guess = int(action.split()[0])
            self.low, self.high = (max(self.low, guess + 1), self.high) if message == "higher :" else (
                self.low, min(self.high, guess - 1))
        return message, reward, done


class AnswersOtherwise(toy.GuessTheNumber):
    """Guess-the-number that answers every guess with the same message, as an environment changed between a run and
    its resumption would."""

    def step(self, action: str) -> tuple[str | None, float, bool]:
        return "try again :", 0.0, False


class Calculator:
    """A tool environment of a researcher's own: the row's question first, tools `add` and `divide`; a turn without
    a tool call is the answer (reward 1 when it holds the row's answer), which ends the episode."""

    def __init__(self):
        self.tools = [self.add, self.divide]
        self.steps = 0

    def add(self, a: int, b: int) -> int:
        """Add two whole numbers.

        Args:
            a: the first number
            b: the second number
        """
        return a + b

    def divide(self, a: int, b: int) -> float:
        """Divide one whole number by another.

        Args:
            a: the dividend
            b: the divisor
        """
        return a / b

    def reset(self, row: dict, seed: int) -> list[dict]:
        self.answer = str(row.get("answer", "five"))
        return [{"role": "system", "content": "answer with a number"}, {"role": "user", "content": row["prompt"]}]

    def step(self, action: str) -> tuple[str | None, float, bool]:
        self.steps += 1
        return None, float(self.answer in action), True


class SlowCalculator(Calculator):
    """Calculator whose step hangs past any --env_timeout of the tests, with a tool `wait` that may too."""

    def __init__(self):
        super().__init__()
        self.tools.append(self.wait)

    def wait(self, seconds: float) -> str:
        """Wait.

        Args:
            seconds: how long
        """
        time.sleep(seconds)
        return "waited"

    def step(self, action: str) -> tuple[str | None, float, bool]:
        time.sleep(3600)


class OddCalculator(Calculator):
    """Calculator with tools whose results are not JSON: a set, a numpy integer."""

    def __init__(self):
        super().__init__()
        self.tools += [self.digits, self.numpy_add]

    def digits(self, n: int) -> set:
        """The digits of a number.

        Args:
            n: the number
        """
        return {int(digit) for digit in str(n)}

    def numpy_add(self, a: int, b: int):
        """Add two whole numbers in numpy.

        Args:
            a: the first number
            b: the second number
        """
        import numpy

        return numpy.int64(a) + numpy.int64(b)


class FlakyCalculator(Calculator):
    """Calculator whose step fails when the question's first number is odd, as a flaky grader service would."""

    def reset(self, row: dict, seed: int) -> list[dict]:
        self.flaky = row["prompt"].split()[2] in ("one", "three", "five", "seven", "nine")
        return super().reset(row, seed)

    def step(self, action: str) -> tuple[str | None, float, bool]:
        if self.flaky:
            raise ConnectionError("the grader is down")
        return super().step(action)


class BrokenGrader(Calculator):
    """Calculator whose step always fails: every episode fails or is truncated."""

    def step(self, action: str) -> tuple[str | None, float, bool]:
        raise ConnectionError("the grader is down")


class TRLGuessWord:
    """Written as TRL's documentation writes an environment for GRPOTrainer(environment_factory=...): reset(**kwargs)
    gets the row's columns and returns None (the prompt is the row's), its public method `guess` is its tool (it
    raises once the game is over), get_reward() the episode's reward."""

    def __init__(self):
        self.reward = 0.0

    def reset(self, **kwargs) -> str | None:
        self.target = kwargs["answer"]
        self.reward = 0.0
        self.done = False
        return None

    def guess(self, word: str) -> str:
        """
        Guess the word.

        Args:
            word: The guessed word

        Returns:
            Whether it is the word.
        """
        if self.done:
            raise ValueError("Game over.")
        self.done = word == self.target
        self.reward = float(self.done)
        return "Right." if self.done else "Wrong."

    def get_reward(self) -> float:
        return self.reward


class TRLGuessWordObserved(TRLGuessWord):
    """TRLGuessWord whose reset returns an observation, which TRL appends to the prompt's last message."""

    def reset(self, **kwargs) -> str | None:
        super().reset(**kwargs)
        return "Five letters at most."
