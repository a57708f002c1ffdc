"""Self-consistency on 20 arithmetic word problems with the real model, next to constrained greedy decoding.

Every sample is constrained to ``{"answer": <integer 0-999>}`` (optionally with a short ``reasoning`` string first);
self-consistency draws N samples per problem at temperature T and votes on ``/answer``. Greedy is one
constrained sample at temperature 0 on the same prompts, in the same run. Prints, per problem, the truth, the
greedy answer, the voted answer, the votes and the agreement ratio; then both accuracies and the times.

    python bench/self_consistency.py [--n 8] [--temperature 0.8] [--reasoning 0]
"""

import argparse
import json
import statistics
import time

from corral.engine.config import EngineConfig
from corral.engine.llm_engine import LLMEngine
from corral.engine.sampling_params import SamplingParams
from corral.engine.self_consistency import majority_vote, self_consistency_many
from corral.fsm.compiler import GrammarCompiler
from corral.grammar.constraint import Constraint

PROBLEMS = [
    ("Tom has 3 apples and buys 5 more. How many apples does Tom have now?", 8),
    ("A box holds 12 pencils. Sara takes 4 pencils out. How many pencils are left in the box?", 8),
    ("There are 6 birds on a tree and 7 more birds land on it. How many birds are on the tree?", 13),
    ("Ben reads 10 pages a day for 3 days. How many pages does he read in total?", 30),
    ("A pizza is cut into 8 slices. Two friends eat 3 slices each. How many slices are left?", 2),
    ("Lily has 20 stickers and gives half of them to her brother. How many stickers does she keep?", 10),
    ("A bus has 15 passengers. At the stop 6 get off and 4 get on. How many passengers are on the bus?", 13),
    ("Each bag has 5 oranges. How many oranges are in 4 bags?", 20),
    ("Mark had 9 dollars and spent 2 dollars on candy. How many dollars does he have left?", 7),
    ("A farmer has 4 cows and 6 sheep. How many animals does the farmer have?", 10),
    ("There are 24 students split equally into 3 groups. How many students are in each group?", 8),
    ("Anna is 7 years old. Her sister is 5 years older. How old is her sister?", 12),
    ("A shelf has 3 rows with 9 books in each row. How many books are on the shelf?", 27),
    ("Jack ran 2 miles on Monday and 3 miles on Tuesday. How many miles did he run in total?", 5),
    ("A baker made 30 cookies and sold 18. How many cookies does the baker have left?", 12),
    ("There are 5 cars and each car has 4 wheels. How many wheels are there?", 20),
    ("Emma had 14 marbles and lost 5. Then she found 2. How many marbles does she have?", 11),
    ("A garden has 7 rows of 7 flowers. How many flowers are in the garden?", 49),
    ("Sam has 100 coins and spends 40 coins. How many coins does Sam have now?", 60),
    ("A class has 11 boys and 13 girls. How many children are in the class?", 24),
]


def schema(reasoning_chars: int) -> dict:
    # Bounded, so that a sample cannot spend its whole budget on one runaway number.
    properties = {"answer": {"type": "integer", "minimum": 0, "maximum": 999}}
    if reasoning_chars:
        properties = {"reasoning": {"type": "string", "maxLength": reasoning_chars}, **properties}
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--reasoning", type=int, default=0, help="max characters of a reasoning field (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    engine = LLMEngine(EngineConfig(max_num_seqs=64))
    compiler = GrammarCompiler(engine.vocabulary)
    answer_schema = schema(args.reasoning)
    max_tokens = 24 + args.reasoning
    prompts = [engine.tokenizer.apply_chat_template([
        {"role": "system", "content": "Solve the arithmetic word problem. Reply with JSON: "
                                      + json.dumps({k: "..." for k in answer_schema["properties"]})},
        {"role": "user", "content": question}]) for question, _ in PROBLEMS]

    start = time.perf_counter()
    grammar = compiler.compile(Constraint("json_schema", answer_schema))
    greedy_outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens),
                                     [grammar.new_guide() for _ in prompts])
    greedy = [majority_vote([o.outputs[0].text], "/answer").answer for o in greedy_outputs]
    greedy_s = time.perf_counter() - start

    start = time.perf_counter()
    params = SamplingParams(n=args.n, temperature=args.temperature, max_tokens=max_tokens, seed=args.seed)
    results = self_consistency_many(engine, compiler, prompts, answer_schema, pointer="/answer", params=params)
    voted_s = time.perf_counter() - start

    print(f"{'#':>2} {'truth':>5} {'greedy':>6} {'voted':>5} {'agree':>5}  votes")
    for i, ((_, truth), g, r) in enumerate(zip(PROBLEMS, greedy, results)):
        print(f"{i:>2} {truth:>5} {g!s:>6} {r.answer!s:>5} {r.agreement:>5.2f}  {r.votes}"
              + (f" (+{r.num_abstained} abstained)" if r.num_abstained else ""))
    greedy_correct = sum(g == truth for g, (_, truth) in zip(greedy, PROBLEMS))
    voted_correct = sum(r.answer == truth for r, (_, truth) in zip(results, PROBLEMS))
    print(f"accuracy: greedy {greedy_correct}/{len(PROBLEMS)}, self-consistency (n={args.n}, "
          f"T={args.temperature}) {voted_correct}/{len(PROBLEMS)}")
    print(f"mean agreement {statistics.mean(r.agreement for r in results):.2f}; "
          f"time: greedy {greedy_s:.1f} s, self-consistency {voted_s:.1f} s")


if __name__ == "__main__":
    main()
