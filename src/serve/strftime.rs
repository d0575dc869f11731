//! Python's `strftime` for the formats chat templates use (Llama 3.1's "%d %b %Y"), over a
//! UTC time, without a date library.

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// The civil date (year, month 1-12, day 1-31) of a day count since 1970-01-01 (Howard
/// Hinnant's days-to-civil).
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// `format` with %Y %y %m %d %e %B %b %A %a %H %I %M %S %p %j %% replaced for the UTC time
/// `secs` seconds after the epoch; other directives are kept as written.
pub fn format_utc(secs: u64, format: &str) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let (hour, minute, second) = (rem / 3600, rem % 3600 / 60, rem % 60);
    let (year, month, day) = civil(days);
    let month_name = MONTHS[(month as usize).saturating_sub(1) % 12];
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = DAYS[((days + 3).rem_euclid(7)) as usize];
    let day_of_year = days - days_before_year(year) + 1;
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:2}")),
            Some('B') => out.push_str(month_name),
            Some('b') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(weekday),
            Some('a') => out.push_str(&weekday[..3]),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{:02}", (hour + 11) % 12 + 1)),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('j') => out.push_str(&format!("{day_of_year:03}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days from 1970-01-01 to January 1st of `year`.
fn days_before_year(year: i64) -> i64 {
    let y = year - 1;
    let leaps = |y: i64| y.div_euclid(4) - y.div_euclid(100) + y.div_euclid(400);
    365 * (year - 1970) + leaps(y) - leaps(1969)
}

#[cfg(test)]
mod tests {
    use super::format_utc;

    #[test]
    fn known_dates_format_as_python_does() {
        // 2024-07-23 14:05:09 UTC, a Tuesday, day 205 of a leap year.
        let t = 1_721_743_509;
        assert_eq!(format_utc(t, "%d %b %Y"), "23 Jul 2024");
        assert_eq!(
            format_utc(t, "%A %a %B %m/%d/%y %H:%M:%S %I%p %j %%"),
            "Tuesday Tue July 07/23/24 14:05:09 02PM 205 %"
        );
        assert_eq!(format_utc(0, "%Y-%m-%d %A"), "1970-01-01 Thursday");
        assert_eq!(format_utc(951_782_400, "%Y-%m-%d %j"), "2000-02-29 060");
        assert_eq!(format_utc(0, "%Q %"), "%Q %");
    }
}
