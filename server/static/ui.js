// Small DOM helpers the tabs share.

export const $ = (id) => document.getElementById(id);

/** Enter sends, Shift+Enter starts a new line. */
export function submitOnEnter(textarea) {
  textarea.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      textarea.form.requestSubmit();
    }
  });
}

/** Keep a scrolling box at its end as content arrives. */
export function followEnd(box) {
  new MutationObserver(() => {
    box.scrollTop = box.scrollHeight;
  }).observe(box, {childList: true, subtree: true, characterData: true});
}
