"""A reward function with two components, for GDPO's end-to-end test (`algorithm.gdpo_reward_keys`)."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """accuracy_reward: the exact answer; format_reward: a bare integer; score: their sum."""
    accuracy = 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0
    well_formed = 1.0 if solution_str.strip().lstrip("-").isdigit() else 0.0
    return {"score": accuracy + well_formed, "accuracy_reward": accuracy, "format_reward": well_formed}
