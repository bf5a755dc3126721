"""The algorithm room: advantages (group-relative, GAE), policy / value / KL losses, PPO's critic, and which
samples train where (uniform groups, balance across ranks)."""
