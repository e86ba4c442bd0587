//! The demo's report: the table, whether the goal was met, and the accuracy curves as SVG.

use crate::mistakes::AfterMistake;
use crate::settings::DemoSettings;
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

/// Whether a scenario reached the goal of the issue.
#[derive(Debug, Clone, Serialize)]
pub struct Goal {
    /// 90% of the teacher's accuracy.
    pub target_accuracy: f64,
    /// First evaluated step at which each method reached the target (None: not within budget).
    pub on_policy_steps: Option<u64>,
    pub off_policy_steps: Option<u64>,
    pub sft_steps: Option<u64>,
    /// On-policy's final accuracy over SFT's (infinite when SFT ends at 0 and on-policy above).
    pub on_policy_over_sft: f64,
    /// The final-accuracy ratio the goal asks for (1: none).
    pub min_ratio: f64,
    /// On-policy reached the target in at most a fifth of the steps SFT needed (or SFT did not
    /// reach it within the budget and on-policy did within a fifth of it), and ended at least
    /// `min_ratio` × SFT's accuracy.
    pub met: bool,
}

/// One scenario's rows: the common starting point and the methods, with its goal.
#[derive(Debug, Clone, Serialize)]
pub struct Scenario {
    /// Training records with a worked solution (SFT, off-policy and the warm-up train on them).
    pub labelled_records: usize,
    /// Training prompts on-policy samples from (with or without their solutions).
    pub prompts: usize,
    /// Whether on-policy read its prompts from a file without solutions.
    pub prompts_only: bool,
    pub student_init: Row,
    pub sft: Row,
    pub off_policy: Row,
    pub on_policy: Row,
    pub goal: Goal,
}

impl Scenario {
    /// The methods' curves, for the SVG and `curves.json`.
    pub fn curves(&self) -> Curves<'_> {
        Curves {
            sft: &self.sft.curve,
            off_policy: &self.off_policy.curve,
            on_policy: &self.on_policy.curve,
        }
    }
}

/// `OUTPUT/summary.json`.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub teacher: Row,
    /// The teacher's next-digit accuracy after a mistake in the text (`xdistill_demo::mistakes`).
    pub teacher_after_mistake: AfterMistake,
    /// The headline: few labels, all prompts, a teacher that knows the task.
    pub scarce: Option<Scenario>,
    /// Every training problem labelled (the data itself is a perfect teacher).
    pub control: Option<Scenario>,
    pub settings: DemoSettings,
    /// Wall time of the whole demo, and whether the teacher came from the cache.
    pub wall_seconds: f64,
    pub teacher_cached: bool,
}

/// The three methods' accuracy curves of one scenario.
#[derive(Debug, Clone, Copy)]
pub struct Curves<'a> {
    pub sft: &'a [(u64, f64)],
    pub off_policy: &'a [(u64, f64)],
    pub on_policy: &'a [(u64, f64)],
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
/// than the budget), and ends at `min_ratio` × SFT's final accuracy or more.
pub fn goal(teacher_acc: f64, c: &Curves, budget: u64, min_ratio: f64) -> Goal {
    let target = 0.9 * teacher_acc;
    let (on_s, sft_s) = (steps_to(c.on_policy, target), steps_to(c.sft, target));
    let last = |c: &[(u64, f64)]| c.last().map(|p| p.1).unwrap_or(0.0);
    let (on_end, sft_end) = (last(c.on_policy), last(c.sft));
    let ratio = if sft_end > 0.0 {
        on_end / sft_end
    } else if on_end > 0.0 {
        f64::INFINITY
    } else {
        0.0
    };
    let fast = match (on_s, sft_s) {
        (Some(o), Some(s)) => 5 * o <= s,
        (Some(o), None) => 5 * o <= budget,
        _ => false,
    };
    Goal {
        target_accuracy: target,
        on_policy_steps: on_s,
        off_policy_steps: steps_to(c.off_policy, target),
        sft_steps: sft_s,
        on_policy_over_sft: ratio,
        min_ratio,
        met: fast && ratio >= min_ratio - 1e-9 && target > 0.0,
    }
}

/// The printed table of one scenario (the teacher first).
pub fn table(teacher: &Row, s: &Scenario) -> String {
    let mut t = format!(
        "{:<14} {:>9} {:>9} {:>7} {:>9} {:>12}\n",
        "method", "accuracy", "KL", "steps", "seconds", "to 90% of T"
    );
    let target = s.goal.target_accuracy;
    for (name, r) in [
        ("teacher", teacher),
        ("student_init", &s.student_init),
        ("sft", &s.sft),
        ("off_policy", &s.off_policy),
        ("on_policy", &s.on_policy),
    ] {
        let reached = if r.curve.is_empty() {
            String::new()
        } else {
            steps_to(&r.curve, target).map_or("never".into(), |s| s.to_string())
        };
        t += &format!(
            "{name:<14} {:>9.3} {:>9.4} {:>7} {:>9.1} {reached:>12}\n",
            r.accuracy, r.kl, r.steps, r.seconds
        );
    }
    t
}

/// The y axis of [`plot`]: its label, its top (the bottom is 0), and a dashed reference line.
pub struct PlotAxis<'a> {
    pub label: &'a str,
    pub max: f64,
    pub reference: Option<(&'a str, f64)>,
}

/// A small SVG line plot of the accuracy curves (no plotting dependency).
pub fn svg(curves: &[(&str, &[(u64, f64)])], teacher_acc: f64, budget: u64) -> String {
    let axis = PlotAxis {
        label: "held-out accuracy (greedy)",
        max: 1.0,
        reference: Some(("teacher", teacher_acc)),
    };
    plot(curves, &axis, budget)
}

/// A small SVG line plot of curves over training steps `0..=budget` (no plotting dependency).
pub fn plot(curves: &[(&str, &[(u64, f64)])], axis: &PlotAxis, budget: u64) -> String {
    let (w, h, l, r, top, bot) = (560.0, 340.0, 50.0, 130.0, 20.0, 40.0);
    let (pw, ph) = (w - l - r, h - top - bot);
    let max = if axis.max > 0.0 && axis.max.is_finite() {
        axis.max
    } else {
        1.0
    };
    let x = |s: u64| l + pw * s as f64 / budget.max(1) as f64;
    let y = |a: f64| top + ph * (1.0 - (a / max).clamp(0.0, 1.0));
    let mut o = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    let digits = if max >= 10.0 {
        0
    } else {
        1 + usize::from(max < 1.0)
    };
    for i in 0..=5 {
        let a = max * i as f64 / 5.0;
        o += &format!(
            "<line x1=\"{l}\" x2=\"{}\" y1=\"{y:.1}\" y2=\"{y:.1}\" stroke=\"#ddd\"/><text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{a:.digits$}</text>\n",
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
         <text x=\"14\" y=\"{:.1}\" transform=\"rotate(-90 14 {:.1})\" text-anchor=\"middle\">{}</text>\n",
        l + pw / 2.0,
        h - 6.0,
        top + ph / 2.0,
        top + ph / 2.0,
        axis.label
    );
    let reference_y = axis.reference.map(|(_, v)| y(v));
    if let (Some((name, _)), Some(t)) = (axis.reference, reference_y) {
        o += &format!(
            "<line x1=\"{l}\" x2=\"{}\" y1=\"{t:.1}\" y2=\"{t:.1}\" stroke=\"black\" stroke-dasharray=\"5,4\"/>\n\
             <text x=\"{}\" y=\"{:.1}\">{name}</text>\n",
            l + pw,
            l + pw + 8.0,
            t + 4.0,
        );
    }
    let colors = ["#1f77b4", "#ff7f0e", "#2ca02c"];
    // The legend sits in the right margin, in the half the reference's label is not in.
    let legend_top = if reference_y.is_some_and(|t| t < top + ph / 2.0) {
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

    type Curve = [(u64, f64)];

    fn curves<'a>(sft: &'a Curve, off_policy: &'a Curve, on_policy: &'a Curve) -> Curves<'a> {
        Curves {
            sft,
            off_policy,
            on_policy,
        }
    }

    #[test]
    fn goal_compares_steps_to_ninety_percent_of_the_teacher() {
        // Teacher 0.8: target 0.72.
        let on = [(0, 0.0), (10, 0.5), (20, 0.75), (100, 0.8)];
        let sft_slow = [(0, 0.0), (50, 0.3), (100, 0.73)];
        let sft_fast = [(0, 0.0), (50, 0.72), (100, 0.8)];
        let never = [(0, 0.0), (100, 0.7)];
        let c = |sft, on| curves(sft, &never, on);
        let g = goal(0.8, &c(&sft_slow, &on), 100, 1.0);
        assert!((g.target_accuracy - 0.72).abs() < 1e-12);
        assert_eq!(
            (g.on_policy_steps, g.sft_steps, g.off_policy_steps),
            (Some(20), Some(100), None)
        );
        assert!(g.met, "20 * 5 <= 100");
        assert!(!goal(0.8, &c(&sft_fast, &on), 100, 1.0).met, "20 * 5 > 50");
        // SFT never gets there: judged against the budget.
        assert!(goal(0.8, &c(&never, &on), 100, 1.0).met);
        assert!(!goal(0.8, &c(&never, &on), 99, 1.0).met);
        // On-policy never gets there, or a teacher at 0: not met.
        assert!(!goal(0.8, &c(&sft_slow, &never), 100, 1.0).met);
        assert!(!goal(0.0, &c(&never, &on), 100, 1.0).met);
    }

    #[test]
    fn goal_asks_for_the_final_ratio_over_sft() {
        let on = [(0, 0.0), (20, 0.75), (100, 0.8)];
        let sft_weak = [(0, 0.0), (100, 0.4)];
        let sft_half_way = [(0, 0.0), (100, 0.41)];
        let zero = [(0, 0.0), (100, 0.0)];
        let c = |sft| curves(sft, &zero, &on);
        let g = goal(0.8, &c(&sft_weak), 100, 2.0);
        assert!((g.on_policy_over_sft - 2.0).abs() < 1e-12 && g.met, "{g:?}");
        assert!(
            !goal(0.8, &c(&sft_half_way), 100, 2.0).met,
            "0.8 / 0.41 < 2"
        );
        assert!(goal(0.8, &c(&sft_half_way), 100, 1.0).met);
        let g = goal(0.8, &c(&zero), 100, 2.0);
        assert!(g.on_policy_over_sft.is_infinite() && g.met);
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

    #[test]
    fn plot_scales_to_its_axis() {
        let c: Vec<(u64, f64)> = vec![(0, 8.0), (10, 2.0)];
        let axis = PlotAxis {
            label: "KL",
            max: 8.0,
            reference: None,
        };
        let s = plot(&[("a", &c)], &axis, 10);
        // (0, 8.0) is the top-left corner; (10, 2.0) a quarter up at the right: y = 20 + 280 * 0.75.
        assert!(s.contains("50.0,20.0 430.0,230.0"), "{s}");
        assert!(
            !s.contains("stroke-dasharray"),
            "no reference line asked for"
        );
    }
}
