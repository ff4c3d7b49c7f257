// Wide figures (issue 37) may use the secondary sidebar's width (book/_static/layout.css): fold the
// table of contents while one is on screen, as sphinx-book-theme does for its full-width content.
document.addEventListener("DOMContentLoaded", function () {
  var sidebar = document.querySelector(".bd-sidebar-secondary");
  if (!sidebar || !("IntersectionObserver" in window)) { return; }
  var shown = new Set();
  var observer = new IntersectionObserver(function (entries) {
    entries.forEach(function (entry) {
      var img = entry.target;
      var wide = img.getBoundingClientRect().width > img.parentElement.clientWidth + 1;
      if (entry.isIntersecting && wide) { shown.add(img); } else { shown.delete(img); }
    });
    sidebar.classList.toggle("gps-wide-figure", shown.size > 0);
  }, {rootMargin: "0px 0px -33% 0px"});
  document.querySelectorAll(".bd-content div.cell_output > img").forEach(function (img) {
    observer.observe(img);
  });
});
