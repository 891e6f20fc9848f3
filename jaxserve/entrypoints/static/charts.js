// Two small canvas charts, drawn from scratch on every update: a line over time and bars over
// labelled buckets. Colours come from the page's CSS variables (light and dark themes).

const PAD = {left: 44, right: 8, top: 8, bottom: 22};

function setup(canvas) {
  // Draw at the screen's pixel density, at the width CSS gives the canvas.
  const dpr = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  canvas.width = Math.round(width * dpr);
  canvas.height = Math.round(height * dpr);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  const css = getComputedStyle(canvas);
  const color = name => css.getPropertyValue(name).trim();
  ctx.font = `11px ${css.fontFamily}`;
  return {ctx, width, height, fg: color("--muted"), grid: color("--grid"), accent: color("--accent")};
}

// A round axis maximum at or above max: 1, 2 or 5 times a power of ten.
function niceMax(max) {
  if (!(max > 0)) return 1;
  const p = 10 ** Math.floor(Math.log10(max));
  return [1, 2, 5, 10].map(m => m * p).find(v => v >= max);
}

function yAxis(c, max) {
  const {ctx, width, height} = c;
  const h = height - PAD.top - PAD.bottom;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (let i = 0; i <= 4; i++) {
    const y = PAD.top + h - (h * i) / 4;
    ctx.strokeStyle = c.grid;
    ctx.beginPath();
    ctx.moveTo(PAD.left, y);
    ctx.lineTo(width - PAD.right, y);
    ctx.stroke();
    ctx.fillStyle = c.fg;
    ctx.fillText(String(+((max * i) / 4).toPrecision(3)), PAD.left - 4, y);
  }
}

// points: [{t (seconds), v}], oldest first; the x axis spans the last `span` seconds.
export function lineChart(canvas, points, span) {
  const c = setup(canvas);
  const {ctx, width, height} = c;
  ctx.clearRect(0, 0, width, height);
  const max = niceMax(Math.max(0, ...points.map(p => p.v)));
  yAxis(c, max);
  const w = width - PAD.left - PAD.right, h = height - PAD.top - PAD.bottom;
  const now = points.length ? points[points.length - 1].t : 0;
  ctx.fillStyle = c.fg;
  ctx.textBaseline = "top";
  for (const [ago, align] of [[span, "left"], [span / 2, "center"], [0, "right"]]) {
    ctx.textAlign = align;
    ctx.fillText(ago ? `-${ago}s` : "now", PAD.left + w - (w * ago) / span, height - PAD.bottom + 6);
  }
  ctx.strokeStyle = c.accent;
  ctx.lineWidth = 2;
  ctx.beginPath();
  points.forEach((p, i) => {
    const x = PAD.left + w - (w * (now - p.t)) / span;
    const y = PAD.top + h - (h * p.v) / max;
    i ? ctx.lineTo(x, y) : ctx.moveTo(x, y);
  });
  ctx.stroke();
  ctx.lineWidth = 1;
}

// One bar per bucket: values[i] above labels[i].
export function barChart(canvas, labels, values) {
  const c = setup(canvas);
  const {ctx, width, height} = c;
  ctx.clearRect(0, 0, width, height);
  const max = niceMax(Math.max(0, ...values));
  yAxis(c, max);
  const w = width - PAD.left - PAD.right, h = height - PAD.top - PAD.bottom;
  const slot = w / values.length;
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  values.forEach((v, i) => {
    const x = PAD.left + slot * i;
    ctx.fillStyle = c.accent;
    ctx.fillRect(x + 1, PAD.top + h - (h * v) / max, slot - 2, (h * v) / max);
    if (i % Math.ceil(40 / slot) === 0) {  // as many labels as fit
      ctx.fillStyle = c.fg;
      ctx.fillText(labels[i], x + slot / 2, height - PAD.bottom + 6);
    }
  });
}
