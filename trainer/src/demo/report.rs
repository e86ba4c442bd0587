//! The demo's report: the table, whether the goal was met, and the accuracy curves as SVG.

use super::settings::DemoSettings;
use serde::Serialize;

/// One row of the table.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub accuracy: f64,
    pub kl: f64,
    pub steps: u64,
    pub seconds: f64,
    /// Greedy held-out accuracy by step (step 0 is the initial student).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub curve: Vec<(u64, f64)>,
}

/// Whether the run reached the goal of the issue.
#[derive(Debug, Clone, Serialize)]
pub struct Goal {
    /// 90% of the teacher's accuracy.
    pub target_accuracy: f64,
    /// First evaluated step at which each method reached the target (None: not within budget).
    pub on_policy_steps: Option<u64>,
    pub off_policy_steps: Option<u64>,
    pub sft_steps: Option<u64>,
    /// On-policy reached the target, in at most a fifth of the steps SFT needed (or SFT did not
    /// reach it within the budget and on-policy did within a fifth of it).
    pub met: bool,
}

/// `OUTPUT/summary.json`.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub teacher: Row,
    pub student_init: Row,
    pub sft: Row,
    pub off_policy: Row,
    pub on_policy: Row,
    pub goal: Goal,
    pub settings: DemoSettings,
    /// Wall time of the whole demo, and whether the teacher came from the cache.
    pub wall_seconds: f64,
    pub teacher_cached: bool,
}

/// First evaluated step whose accuracy reaches `target`.
pub fn steps_to(curve: &[(u64, f64)], target: f64) -> Option<u64> {
    // The tolerance keeps e.g. 0.72 ≥ 0.9 × 0.8 (= 0.7200000000000001) true.
    curve
        .iter()
        .find(|(_, a)| *a >= target - 1e-9)
        .map(|(s, _)| *s)
}

/// The goal: on-policy reaches 90% of the teacher's accuracy in at most a fifth of the
/// steps SFT needs to get as far (SFT not reaching it within the budget counts as needing more
/// than the budget).
pub fn goal(
    teacher_acc: f64,
    sft: &[(u64, f64)],
    off: &[(u64, f64)],
    on: &[(u64, f64)],
    budget: u64,
) -> Goal {
    let target = 0.9 * teacher_acc;
    let (on_s, sft_s) = (steps_to(on, target), steps_to(sft, target));
    let met = match (on_s, sft_s) {
        (Some(o), Some(s)) => 5 * o <= s,
        (Some(o), None) => 5 * o <= budget,
        _ => false,
    } && target > 0.0;
    Goal {
        target_accuracy: target,
        on_policy_steps: on_s,
        off_policy_steps: steps_to(off, target),
        sft_steps: sft_s,
        met,
    }
}

/// The printed table.
pub fn table(s: &Summary) -> String {
    let mut t = format!(
        "{:<14} {:>9} {:>9} {:>7} {:>9}\n",
        "method", "accuracy", "KL", "steps", "seconds"
    );
    for (name, r) in [
        ("teacher", &s.teacher),
        ("student_init", &s.student_init),
        ("sft", &s.sft),
        ("off_policy", &s.off_policy),
        ("on_policy", &s.on_policy),
    ] {
        t += &format!(
            "{name:<14} {:>9.3} {:>9.4} {:>7} {:>9.1}\n",
            r.accuracy, r.kl, r.steps, r.seconds
        );
    }
    t
}

/// A small SVG line plot of the accuracy curves (no plotting dependency).
pub fn svg(curves: &[(&str, &[(u64, f64)])], teacher_acc: f64, budget: u64) -> String {
    let (w, h, l, r, top, bot) = (560.0, 340.0, 50.0, 130.0, 20.0, 40.0);
    let (pw, ph) = (w - l - r, h - top - bot);
    let x = |s: u64| l + pw * s as f64 / budget.max(1) as f64;
    let y = |a: f64| top + ph * (1.0 - a.clamp(0.0, 1.0));
    let mut o = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    for i in 0..=5 {
        let a = i as f64 / 5.0;
        o += &format!(
            "<line x1=\"{l}\" x2=\"{}\" y1=\"{y:.1}\" y2=\"{y:.1}\" stroke=\"#ddd\"/><text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{a:.1}</text>\n",
            l + pw,
            l - 6.0,
            y(a) + 4.0,
            y = y(a)
        );
    }
    for i in 0..=4 {
        let s = budget * i / 4;
        o += &format!(
            "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{s}</text>\n",
            x(s),
            top + ph + 16.0
        );
    }
    o += &format!(
        "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">training step</text>\n\
         <text x=\"14\" y=\"{:.1}\" transform=\"rotate(-90 14 {:.1})\" text-anchor=\"middle\">held-out accuracy (greedy)</text>\n",
        l + pw / 2.0,
        h - 6.0,
        top + ph / 2.0,
        top + ph / 2.0
    );
    o += &format!(
        "<line x1=\"{l}\" x2=\"{}\" y1=\"{t:.1}\" y2=\"{t:.1}\" stroke=\"black\" stroke-dasharray=\"5,4\"/>\n\
         <text x=\"{}\" y=\"{:.1}\">teacher</text>\n",
        l + pw,
        l + pw + 8.0,
        y(teacher_acc) + 4.0,
        t = y(teacher_acc)
    );
    let colors = ["#1f77b4", "#ff7f0e", "#2ca02c"];
    // The legend sits in the right margin, in the half the teacher's label is not in.
    let legend_top = if y(teacher_acc) < top + ph / 2.0 {
        top + ph / 2.0
    } else {
        top + 20.0
    };
    for (i, (name, c)) in curves.iter().enumerate() {
        let pts: Vec<String> = c
            .iter()
            .map(|(s, a)| format!("{:.1},{:.1}", x(*s), y(*a)))
            .collect();
        let color = colors[i % colors.len()];
        o += &format!(
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" points=\"{}\"/>\n\
             <text x=\"{}\" y=\"{}\" fill=\"{color}\">{name}</text>\n",
            pts.join(" "),
            l + pw + 8.0,
            legend_top + 16.0 * i as f64
        );
    }
    o + "</svg>\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn goal_compares_steps_to_ninety_percent_of_the_teacher() {
        // Teacher 0.8: target 0.72.
        let on = [(0, 0.0), (10, 0.5), (20, 0.75), (100, 0.8)];
        let sft_slow = [(0, 0.0), (50, 0.3), (100, 0.73)];
        let sft_fast = [(0, 0.0), (50, 0.72), (100, 0.8)];
        let never = [(0, 0.0), (100, 0.7)];
        let g = goal(0.8, &sft_slow, &never, &on, 100);
        assert!((g.target_accuracy - 0.72).abs() < 1e-12);
        assert_eq!(
            (g.on_policy_steps, g.sft_steps, g.off_policy_steps),
            (Some(20), Some(100), None)
        );
        assert!(g.met, "20 * 5 <= 100");
        assert!(!goal(0.8, &sft_fast, &never, &on, 100).met, "20 * 5 > 50");
        // SFT never gets there: judged against the budget.
        assert!(goal(0.8, &never, &never, &on, 100).met);
        assert!(!goal(0.8, &never, &never, &on, 99).met);
        // On-policy never gets there, or a teacher at 0: not met.
        assert!(!goal(0.8, &sft_slow, &never, &never, 100).met);
        assert!(!goal(0.0, &never, &never, &on, 100).met);
    }

    #[test]
    fn svg_has_a_line_per_method_and_the_teacher() {
        let c: Vec<(u64, f64)> = vec![(0, 0.0), (50, 0.5), (100, 1.0)];
        let s = svg(&[("a", &c), ("b", &c)], 0.9, 100);
        assert_eq!(s.matches("<polyline").count(), 2);
        assert!(s.contains(">teacher<"));
        // Step 100 of 100 at accuracy 1.0 is the plot's top-right corner (x = 50 + 380, y = 20).
        assert!(s.contains("430.0,20.0"), "{s}");
    }
}
